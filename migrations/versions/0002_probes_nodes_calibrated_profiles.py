"""probes, nodes, calibrated profiles

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 15:54:29.681120
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("node_id", sa.String(length=128), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("alive", sa.Boolean(), nullable=False),
        sa.Column("info", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("node_id"),
    )
    op.create_table(
        "probes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("results", sa.JSON(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("probes", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_probes_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_probes_status"), ["status"], unique=False)

    op.create_table(
        "profiles",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("probe_id", sa.Integer(), nullable=True),
        sa.Column("profile", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["probe_id"], ["probes.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("profiles")
    with op.batch_alter_table("probes", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_probes_status"))
        batch_op.drop_index(batch_op.f("ix_probes_job_id"))

    op.drop_table("probes")
    op.drop_table("nodes")
