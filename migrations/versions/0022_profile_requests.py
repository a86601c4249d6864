"""profile_requests: `trident profile` runs torch.profiler on a running job's ranks

The API stores a request (steps, ranks, memory), the controller has the named ranks profile
their next steps and stores their traces as files with the job (`service.files.profiles`),
listed in `result` (`service.store.profile_requests`).

Revision ID: 0022
Revises: 0021
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "profile_requests",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("requested_by", sa.String(length=64), nullable=True),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=False),
        sa.Column("memory", sa.Boolean(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_profile_requests_job", "profile_requests", ["job_id", "id"])
    op.create_index("ix_profile_requests_status", "profile_requests", ["status"])


def downgrade() -> None:
    op.drop_index("ix_profile_requests_status", table_name="profile_requests")
    op.drop_index("ix_profile_requests_job", table_name="profile_requests")
    op.drop_table("profile_requests")
