"""leases: one row per named lease, so that exactly one controller acts

The controller holds the `controller` lease while it admits, starts and watches jobs; a
standby takes it over once it has expired. `epoch` counts the hand-overs (a fencing token).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("name", sa.String(length=64), primary_key=True),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("epoch", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("leases")
