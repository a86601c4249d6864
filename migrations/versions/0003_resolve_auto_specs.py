"""stored specs carry the layout that runs: resolve parallel: auto from the plan

A job submitted with `parallel: "auto"` used to be stored with "auto" and resolved by the
controller at every placement. Now the spec is resolved at submission; this rewrites the
specs stored before, from the layout their plan chose, so that they run unchanged.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("spec", sa.JSON),
                 sa.column("plan", sa.JSON))


def upgrade() -> None:
    conn = op.get_bind()
    for job_id, spec, plan in conn.execute(sa.select(_jobs.c.id, _jobs.c.spec, _jobs.c.plan)):
        if spec.get("parallel") != "auto":
            continue
        layout = dict(plan["layout"])
        spec = {**spec, "parallel": layout, "train": {**spec.get("train", {}),
                                                      "micro_batch": layout.pop("micro_batch")}}
        conn.execute(_jobs.update().where(_jobs.c.id == job_id).values(spec=spec))


def downgrade() -> None:
    # An explicit layout is a valid spec before this revision too; nothing to undo.
    pass
