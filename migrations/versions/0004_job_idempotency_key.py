"""jobs remember the Idempotency-Key of their submission

A retried `POST /api/v1/jobs` with the same key returns the job the first one created. The
key is unique (NULLs, the jobs submitted without one, do not collide, on SQLite and
PostgreSQL alike); the hash of the submitted spec tells a retry from a different request.
Columns are added and dropped in place: a batch copy of `jobs` would cascade-delete its
attempts, events and metrics on SQLite (foreign keys are on).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("idempotency_key", sa.String(length=255), nullable=True))
    op.add_column("jobs", sa.Column("request_hash", sa.String(length=64), nullable=True))
    op.create_index("ix_jobs_idempotency_key", "jobs", ["idempotency_key"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_jobs_idempotency_key", table_name="jobs")
    op.drop_column("jobs", "request_hash")
    op.drop_column("jobs", "idempotency_key")
