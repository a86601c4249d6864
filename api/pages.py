"""The status page at `/`: jobs and their states, read from the store. It needs a log-in
(`api.session`): a session cookie, or a Bearer token."""

from __future__ import annotations

from html import escape

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from api.deps import StoreDep
from api.session import PageUser

router = APIRouter(include_in_schema=False)

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Trident</title>
<meta http-equiv="refresh" content="5">
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem; color: #222; }}
table {{ border-collapse: collapse; }} td, th {{ padding: .3rem .8rem; text-align: left; }}
tr:nth-child(even) {{ background: #f4f4f4; }}
.QUEUED {{ color: #777; }} .RUNNING, .PLACING {{ color: #0a58ca; }}
.SUCCEEDED {{ color: #198754; }} .FAILED {{ color: #dc3545; }} .CANCELLED {{ color: #b58105; }}
</style></head><body>
<h1>Trident</h1>
<p>{who}: {total} jobs. REST API under <a href="/api/v1/jobs">/api/v1</a>, OpenAPI at
<a href="/docs">/docs</a>.</p>
<table id="jobs"><tr><th>id</th><th>name</th><th>state</th><th>layout</th><th>ranks</th>
<th>last step</th><th>last loss</th><th>s/step predicted</th><th>s/step measured</th>
<th>created</th></tr>
{rows}
</table></body></html>"""


@router.get("/", response_class=HTMLResponse)
def index(store: StoreDep, who: PageUser) -> str:
    jobs, total = store.list_jobs(limit=100)
    rows = []
    for j in jobs:
        layout = j.plan.layout.label
        last = store.latest_metric(job_id=j.id)
        step = str(last.step) if last else "-"
        loss = f"{last.loss:.4f}" if last and last.loss is not None else "-"
        predicted = j.plan.time.step_s
        pred = f"{predicted:.4g}" if predicted else "-"
        meas = f"{last.step_time_s:.4g}" if last else "-"
        rows.append(
            f'<tr data-job="{j.id}"><td>{j.id}</td><td>{escape(j.name)}</td>'
            f'<td class="{j.state}">{j.state}</td><td>{escape(layout)}</td>'
            f"<td>{j.world_size}</td><td>{step}</td><td>{loss}</td><td>{pred}</td>"
            f"<td>{meas}</td>"
            f"<td>{j.created_at:%Y-%m-%d %H:%M:%S}</td></tr>")
    return _PAGE.format(total=total, rows="\n".join(rows), who=escape(who.name))
