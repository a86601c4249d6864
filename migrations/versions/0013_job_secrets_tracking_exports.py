"""job_secrets and tracking_exports: a job's sealed secrets, and how far its steps went to
each tracker

`job_secrets` keeps a job's `secrets` apart from its spec, each value sealed with the server's
key (`service.secrets`). `tracking_exports` is the exporter's cursor per job and tracker
(MLflow, TensorBoard): the last step sent, the counts sent and dropped, the MLflow run, the
newest failure (`service.tracking`); a row is made with its job and is `done` once the ended
job's every step and final state went out.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_secrets",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("sealed", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "name"),
    )
    op.create_table(
        "tracking_exports",
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("sink", sa.String(length=16), nullable=False),
        sa.Column("target", sa.String(length=2048), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("experiment_id", sa.String(length=64), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("exported", sa.Integer(), nullable=False),
        sa.Column("dropped", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=True),
        sa.Column("done", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("failing_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "sink"),
    )
    op.create_index("ix_tracking_exports_done", "tracking_exports", ["done"])


def downgrade() -> None:
    op.drop_index("ix_tracking_exports_done", table_name="tracking_exports")
    op.drop_table("tracking_exports")
    op.drop_table("job_secrets")
