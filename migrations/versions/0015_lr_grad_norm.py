"""lr and grad_norm in metrics and step_metrics: the learning rate each step ran at and the
global gradient norm before clipping, per rank and step and per step
(`service.contract.reports.StepReport`), nullable (rows from before, custom entrypoints that
report neither).

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


TABLES = ("metrics", "step_metrics")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("lr", sa.Float(), nullable=True))
            batch.add_column(sa.Column("grad_norm", sa.Float(), nullable=True))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("grad_norm")
            batch.drop_column("lr")
