"""stack_requests: `trident stacks` asks a running job's ranks for their Python stacks

The API stores a request, the controller collects every rank's stacks and stores them grouped
(ranks with identical stacks together) in `result` (`service.stack_requests`).

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stack_requests",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("requested_by", sa.String(length=64), nullable=True),
        sa.Column("result", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_stack_requests_job", "stack_requests", ["job_id", "id"])
    op.create_index("ix_stack_requests_status", "stack_requests", ["status"])


def downgrade() -> None:
    op.drop_index("ix_stack_requests_status", table_name="stack_requests")
    op.drop_index("ix_stack_requests_job", table_name="stack_requests")
    op.drop_table("stack_requests")
