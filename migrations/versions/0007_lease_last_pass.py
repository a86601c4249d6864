"""leases.last_pass_s and a covering index of metrics for the dashboard's charts

`leases.last_pass_s`: the controller's previous pass duration, written with each renewal;
`GET /metrics` (served by the API, another process) reads it as
`trident_controller_pass_duration_seconds`. `ix_metrics_series`: the charts' min/max buckets
over a job's rank-0 steps read this index only, not the rows with their JSON.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("last_pass_s", sa.Float(), nullable=True))
    op.create_index("ix_metrics_series", "metrics", ["job_id", "rank", "step", "attempt", "loss",
                                                     "step_time_s", "tokens_per_s"])


def downgrade() -> None:
    op.drop_index("ix_metrics_series", table_name="metrics")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("last_pass_s")
