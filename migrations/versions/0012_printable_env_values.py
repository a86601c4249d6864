"""stored specs hold printable env values: escape the control characters of older ones

A job's spec is validated when its row is read (`service.views.Job.spec` is a `JobSpec`).
Specs stored before env values had to be printable text may hold control characters (a
newline, a tab, a NUL), which today's `JobSpec` refuses: such a row could no longer be read.
This writes each such character as its escape (`\\n`, `\\t`, `\\x00`), so that the job reads
and shows what it was given, and records an event on the job that says which variables
changed. Nothing else of the spec changes.

Revision ID: 0012
Revises: 0011
"""

import re

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("spec", sa.JSON))
_events = sa.table("events", sa.column("job_id", sa.Integer), sa.column("kind", sa.String),
                   sa.column("message", sa.Text), sa.column("data", sa.JSON),
                   sa.column("time", sa.DateTime(timezone=True)))
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def escape(value: str) -> str:
    """`value` with each control character written as its escape."""
    return _CONTROL.sub(lambda m: _NAMED.get(m.group(), f"\\x{ord(m.group()):02x}"), value)


def upgrade() -> None:
    conn = op.get_bind()
    for job_id, spec in conn.execute(sa.select(_jobs.c.id, _jobs.c.spec)):
        env = spec.get("env") if isinstance(spec, dict) else None
        if not isinstance(env, dict):
            continue
        changed = sorted(k for k, v in env.items() if isinstance(v, str) and _CONTROL.search(v))
        if not changed:
            continue
        env = {k: escape(v) if k in changed else v for k, v in env.items()}
        conn.execute(_jobs.update().where(_jobs.c.id == job_id).values(spec={**spec, "env": env}))
        conn.execute(_events.insert().values(
            job_id=job_id, kind="spec", time=sa.func.now(), data={"escaped": changed},
            message=f"env {', '.join(changed)}: control characters written as escapes (\\n,"
            " \\x00, ...): a spec's environment values are printable text"))


def downgrade() -> None:
    # Escaped values are valid specs before this revision too; nothing to undo.
    pass
