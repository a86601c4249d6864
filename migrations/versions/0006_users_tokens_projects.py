"""users, API tokens, projects with quotas, memberships, the audit log; jobs get a project

Tokens are stored as their SHA-256 only, under a unique index, so a token check is one index
look-up. Jobs already have an `owner` (it was always "local"): the jobs created before this
revision keep it, and their `project` stays NULL (shown as "-"); only an admin may cancel
them. `jobs.waiting` says why a queued job waits (its project's quota). Columns are added in
place: a batch copy of `jobs` would cascade-delete its attempts, events and metrics on SQLite.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(length=64), nullable=False, unique=True),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("disabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("user_id", sa.Integer(), sa.ForeignKey("users.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_tokens_user_id", "tokens", ["user_id"])
    op.create_table(
        "projects",
        sa.Column("name", sa.String(length=64), primary_key=True),
        sa.Column("gpu_quota", sa.Float(), nullable=True),
        sa.Column("cpu_quota", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "memberships",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("user_id", sa.Integer(), sa.ForeignKey("users.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("project", sa.String(length=64),
                  sa.ForeignKey("projects.name", ondelete="CASCADE"), nullable=False),
        sa.UniqueConstraint("user_id", "project"),
    )
    op.create_index("ix_memberships_user_id", "memberships", ["user_id"])
    op.create_table(
        "audit",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=True),
        sa.Column("client", sa.String(length=64), nullable=True),
        sa.Column("method", sa.String(length=8), nullable=False),
        sa.Column("path", sa.String(length=512), nullable=False),
        sa.Column("action", sa.String(length=64), nullable=True),
        sa.Column("status", sa.Integer(), nullable=False),
    )
    op.create_index("ix_audit_time", "audit", ["time"])
    op.add_column("jobs", sa.Column("project", sa.String(length=64), nullable=True))
    op.add_column("jobs", sa.Column("waiting", sa.Text(), nullable=True))
    op.create_index("ix_jobs_owner", "jobs", ["owner"])


def downgrade() -> None:
    op.drop_index("ix_jobs_owner", table_name="jobs")
    op.drop_column("jobs", "waiting")
    op.drop_column("jobs", "project")
    op.drop_index("ix_audit_time", table_name="audit")
    op.drop_table("audit")
    op.drop_index("ix_memberships_user_id", table_name="memberships")
    op.drop_table("memberships")
    op.drop_table("projects")
    op.drop_index("ix_tokens_user_id", table_name="tokens")
    op.drop_table("tokens")
    op.drop_table("users")
