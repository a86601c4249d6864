"""checkpoints, projects.max_priority, jobs.preemptions: checkpoint tags, priority caps,
preemptions

`checkpoints` is one row per tag a job's rank 0 reported complete (`service.checkpoint_index`):
the step, the attempt, its bytes on disk, the layout that wrote it, and when the retention
policy (`checkpoint.keep_last`, `keep_every`) deleted it. `projects.max_priority` is the
highest priority a project's members may give a job (NULL: no cap); `jobs.preemptions` counts
the attempts stopped for a job of higher priority, which spend no retry.

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("layout", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("removed_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "step"),
    )
    # In place (SQLite 3.35+ drops columns too): a batch copy of `jobs` would cascade-delete
    # its attempts, events and metrics on SQLite, whose foreign keys are on.
    op.add_column("projects", sa.Column("max_priority", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("preemptions", sa.Integer(), nullable=False,
                                    server_default="0"))


def downgrade() -> None:
    op.drop_column("jobs", "preemptions")
    op.drop_column("projects", "max_priority")
    op.drop_table("checkpoints")
