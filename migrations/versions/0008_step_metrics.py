"""step_metrics: one row per (job, attempt, step) over all ranks, for jobs of thousands of ranks

Every rank reports every step; a 4,096-rank job at a step a second would be 350 million
per-rank rows a day. The job-level row keeps, per step, the mean/min/max step time, the
worst (slowest) rank, the loss and the job's tokens/s; `service.metrics_ingest` keeps per-rank
rows only for rank 0, a sample of ranks and the stragglers (see there). `rank_bits` records
which ranks are merged in while the step is incomplete (a report sent again is merged once);
it is cleared when every rank has reported.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "step_metrics",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("ranks", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("rank_bits", sa.LargeBinary(), nullable=True),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("step_time_sum", sa.Float(), nullable=False),
        sa.Column("step_time_sumsq", sa.Float(), nullable=False),
        sa.Column("step_time_min", sa.Float(), nullable=False),
        sa.Column("step_time_max", sa.Float(), nullable=False),
        sa.Column("worst_rank", sa.Integer(), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=False),
        sa.Column("stragglers", sa.Integer(), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "attempt", "step"),
    )
    # The primary key serves the job page's queries (a job's steps in order, or its newest
    # steps of the newest attempt, read backwards): no further index to write.


def downgrade() -> None:
    op.drop_table("step_metrics")
