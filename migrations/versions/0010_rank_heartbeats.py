"""rank_heartbeats: each rank's last heartbeat per attempt, as the controller saw it

The controller polls every rank's heartbeat; `GET /metrics`
(`trident_rank_heartbeat_age_seconds`) and the ranks grid are served by the API, another
process. `service.heartbeats` upserts one row per (job, attempt, rank) at most once a second
per attempt, in one statement.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rank_heartbeats",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "attempt", "rank"),
    )
    # The primary key serves both the upsert and the read of an attempt's ranks.


def downgrade() -> None:
    op.drop_table("rank_heartbeats")
