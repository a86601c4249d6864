"""exports: `trident export` writes a job's tag as a Hugging Face folder on the cluster

The API stores the export asked for (its tag's step, destination under an export root,
shard size); the controller runs it as a task on the cluster and records its state, files
and size (`service.store.exports`).

Revision ID: 0023
Revises: 0022
"""

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "exports",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("checkpoint_dir", sa.Text(), nullable=False),
        sa.Column("max_shard_bytes", sa.BigInteger(), nullable=False),
        sa.Column("requested_by", sa.String(length=64), nullable=True),
        sa.Column("files", sa.JSON(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_exports_job", "exports", ["job_id", "id"])
    op.create_index("ix_exports_state", "exports", ["state"])


def downgrade() -> None:
    op.drop_index("ix_exports_state", table_name="exports")
    op.drop_index("ix_exports_job", table_name="exports")
    op.drop_table("exports")
