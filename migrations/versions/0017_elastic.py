"""jobs.elastic: where an elastic job's layout came from, and its moves

`jobs.elastic` (JSON, NULL for a job never re-planned) holds what `service.policy.elastic_replan`
needs to move an elastic job back: the layout, micro-batch, cluster, world size and plan it was
submitted with (`submitted`), and how many of its attempts ended in a move to a larger layout
(`moves_up`: those spend no retry).

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # In place: a batch copy of `jobs` would cascade-delete its rows' children on SQLite.
    op.add_column("jobs", sa.Column("elastic", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "elastic")
