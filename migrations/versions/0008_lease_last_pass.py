"""leases.last_pass_s: the controller's previous pass duration, written with each renewal

`GET /metrics` (served by the API, another process) reads it as
`trident_controller_pass_duration_seconds`.

Revision ID: 0008
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("last_pass_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("last_pass_s")
