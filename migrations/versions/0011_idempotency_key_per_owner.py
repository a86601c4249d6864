"""an Idempotency-Key is unique per owner, not across users

A key was unique over every job, so a user who sent another user's key with the same spec got
that user's job back. The unique index is now on (owner, idempotency_key): the same key from
two users makes two jobs, each its owner's; a retry by the same user still finds the first.
NULL keys (jobs submitted without one) never collide, on SQLite and PostgreSQL alike.

Downgrade: the old index cannot hold one key for two owners, so where several jobs share a
key the oldest keeps it and the others lose it (their retries are long over; the jobs
themselves are kept). Indexes are created and dropped in place: a batch copy of `jobs` would
cascade-delete its attempts, events and metrics on SQLite (foreign keys are on).

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_jobs_idempotency_key", table_name="jobs")
    op.create_index("ix_jobs_owner_idempotency_key", "jobs", ["owner", "idempotency_key"],
                    unique=True)


def downgrade() -> None:
    jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("idempotency_key"))
    older = sa.alias(jobs, "older")
    op.execute(jobs.update()
               .where(sa.exists().where(older.c.idempotency_key == jobs.c.idempotency_key,
                                        older.c.id < jobs.c.id))
               .values(idempotency_key=None))
    op.drop_index("ix_jobs_owner_idempotency_key", table_name="jobs")
    op.create_index("ix_jobs_idempotency_key", "jobs", ["idempotency_key"], unique=True)
