"""metrics, step_metrics: tokens_per_s may be unknown

A command job without a model (`resources.workers` alone) whose script reports no tokens per
second has none: its steps store NULL, not a rate of 0 nobody measured.

Revision ID: 0024
Revises: 0023
"""

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

TABLES = ("metrics", "step_metrics")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.alter_column("tokens_per_s", existing_type=sa.Float(), nullable=True)


def downgrade() -> None:
    for table in TABLES:
        op.execute(f"UPDATE {table} SET tokens_per_s = 0 WHERE tokens_per_s IS NULL")
        with op.batch_alter_table(table) as batch:
            batch.alter_column("tokens_per_s", existing_type=sa.Float(), nullable=False)
