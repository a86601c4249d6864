"""step_metrics: what the goodput ledger reads of each step (when it ended, the seconds its
evaluation, its checkpoint's save and an attempt's checkpoint load took, the step it resumed
from); projects: a budget; jobs: an ended job's ledger

`service.store.goodput` splits a job's wall time into categories from its events, attempts
and these step columns. `ended_at` is the step's end on its slowest rank's clock; `eval_s`,
`save_s`, `load_s` the longest any rank spent on them; `resumed_from` the step of the
checkpoint the attempt resumed from (0: fresh). A project's budget (`budget_gpu_hours`,
`budget_cpu_hours`, `budget_cost`, counted from `budget_since`; `budget_warned_at`: when its
80 % warning was given). `ix_step_metrics_extras` holds the few steps with an evaluation or a
save, which the ledger sums. `jobs.ledger`: an ended job's ledger, kept once computed. All
nullable: the rows there are keep their meaning (a step without them is timed by when it was
stored).

Revision ID: 0020
Revises: 0019
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_STEPS = (("ended_at", sa.DateTime(timezone=True)), ("eval_s", sa.Float()),
          ("save_s", sa.Float()), ("load_s", sa.Float()), ("resumed_from", sa.Integer()))
_EXTRAS = "eval_s IS NOT NULL OR save_s IS NOT NULL"
_PROJECTS = (("budget_gpu_hours", sa.Float()), ("budget_cpu_hours", sa.Float()),
             ("budget_cost", sa.Float()), ("budget_since", sa.DateTime(timezone=True)),
             ("budget_warned_at", sa.DateTime(timezone=True)))


def upgrade() -> None:
    for name, kind in _STEPS:
        op.add_column("step_metrics", sa.Column(name, kind, nullable=True))
    for name, kind in _PROJECTS:
        op.add_column("projects", sa.Column(name, kind, nullable=True))
    op.add_column("jobs", sa.Column("ledger", sa.JSON(), nullable=True))
    op.create_index("ix_step_metrics_extras", "step_metrics", ["job_id", "attempt", "step"],
                    sqlite_where=sa.text(_EXTRAS), postgresql_where=sa.text(_EXTRAS))


def downgrade() -> None:
    # Not batches: recreating `jobs` or `projects` on SQLite would cascade to the rows that
    # refer to them (events, memberships).
    op.drop_index("ix_step_metrics_extras", table_name="step_metrics")
    op.drop_column("jobs", "ledger")
    for name, _ in _PROJECTS:
        op.drop_column("projects", name)
    for name, _ in _STEPS:
        op.drop_column("step_metrics", name)
