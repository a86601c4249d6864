"""nodes: cordon and drain (who, when, why, the drain's deadline), the node's events and the
failed attempts the lemon rule counts

`trident node cordon|drain|uncordon` and the lemon rule (`Settings.lemon_failures`) write a
node's cordon state on its row: `cordoned_at` (NULL: schedulable), `cordoned_by`,
`cordon_reason`, `drain_deadline` (a drain's), `drained_at` (the controller saw no ranks left);
`events` holds the node's newest events and `failures` the failed attempts with ranks there
within the lemon rule's window. All nullable: the rows there are stay schedulable.

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_COLUMNS = ("cordoned_at", "cordoned_by", "cordon_reason", "drain_deadline", "drained_at",
            "events", "failures")


def upgrade() -> None:
    op.add_column("nodes", sa.Column("cordoned_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("nodes", sa.Column("cordoned_by", sa.String(255), nullable=True))
    op.add_column("nodes", sa.Column("cordon_reason", sa.Text(), nullable=True))
    op.add_column("nodes", sa.Column("drain_deadline", sa.DateTime(timezone=True),
                                     nullable=True))
    op.add_column("nodes", sa.Column("drained_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("nodes", sa.Column("events", sa.JSON(), nullable=True))
    op.add_column("nodes", sa.Column("failures", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        for name in _COLUMNS:
            batch.drop_column(name)
