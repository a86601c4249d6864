"""`trident compare A B [C...]` and `trident tensorboard [JOB...]`: runs side by side, and
TensorBoard on the event files the control plane writes.

`compare` prints what `GET /compare` answers (`TridentClient.compare`): a table of each job's
headline figures (steps, loss, eval loss, step time and tokens/s predicted and measured, MFU,
ETTR)
and the spec fields whose values differ; `-o json` prints the whole comparison, curves
included. `tensorboard` asks the server where the files are (`GET /tracking`,
`GET /jobs/{id}/tracking`) and prints the directory, or with `--serve` starts TensorBoard on
it, on loopback unless `--host` says otherwise; the directory must be on this machine (the
server's data directory: run it where `trident up` runs).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.common import DEFAULT_SERVER, ServerOpt, connect, fail
from cli.format import NONFINITE, Output, columns, dump, secs
from client.payloads import Comparison, Measured

JobIds = Annotated[list[int], typer.Argument(help="Job ids.", min=1, show_default=False)]


def _num(v: float | None, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _pair(m: Measured, fmt: Any = _num) -> str:
    return f"{fmt(m.measured)} / {fmt(m.predicted)}"


def _value(v: Any) -> str:
    if v is None:
        return "(unset)"
    return v if isinstance(v, str) else json.dumps(v)


def render(c: Comparison) -> str:
    """The comparison as text: the headline table, then the differing spec fields."""
    rows = []
    for r in c.runs:
        pm = r.predicted_vs_measured
        rows.append([str(r.id), r.name, r.state, r.layout,
                     f"{r.step if r.step is not None else '-'}/{r.total_steps}",
                     NONFINITE if r.loss_nonfinite else _num(r.loss),
                     _num(r.eval_loss), _pair(pm.step_s, secs), _pair(pm.tokens_per_s),
                     f"{_pct(r.mfu)} / {_pct(r.mfu_predicted)}", _pct(r.ettr)])
    out = [columns(["ID", "NAME", "STATE", "LAYOUT", "STEP", "LOSS", "EVAL_LOSS",
                    "S/STEP (MEAS/PRED)", "TOKENS/S (MEAS/PRED)", "MFU (MEAS/PRED)", "ETTR"],
                   rows)]
    out.append("")
    if not c.differences:
        out.append("The specs are the same.")
    else:
        out.append(columns(["FIELD", *(f"JOB {r.id}" for r in c.runs)],
                           [[d.field, *(_value(v) for v in d.values)] for d in c.differences]))
    custom = sorted({k for r in c.runs for k in r.custom})
    if custom:
        out.append("")
        out.append(columns(["CUSTOM", *(f"JOB {r.id}" for r in c.runs)],
                           [[k, *(_num(r.custom.get(k)) for r in c.runs)] for k in custom]))
    return "\n".join(out)


def compare(jobs: JobIds, server: ServerOpt = DEFAULT_SERVER,
            output: Annotated[Output, typer.Option(
                "--output", "-o", case_sensitive=False,
                help="table (default), json or yaml (the whole comparison, curves included)."
            )] = Output.table) -> None:
    """Compare 2 to 8 jobs: a table of their figures (step, loss, eval loss, step time,
    tokens/s and MFU measured against predicted, ETTR), the spec fields that differ, and their
    custom metrics; the dashboard's jobs page opens the same comparison with charts.

    Example: trident compare 12 15 -o json
    """
    if len(jobs) < 2:
        fail("compare: name at least two jobs")
    with connect(server) as client:
        c = client.compare(jobs)
    if output in (Output.json, Output.yaml):
        typer.echo(dump(c, output))
    else:
        typer.echo(render(c))


def _dirs(client: Any, jobs: list[int]) -> list[tuple[str, Path]]:
    """(name, directory) of each job's TensorBoard files, or of the root for no job."""
    if not jobs:
        root = client.tracking_info().tensorboard_dir
        if root is None:
            fail("this server writes no TensorBoard files (TRIDENT_TENSORBOARD=false)")
        return [("all", Path(root))]
    out = []
    for job_id in jobs:
        found = [e for e in client.job_tracking(job_id).exports if e.sink == "tensorboard"]
        if not found or found[0].directory is None:
            fail(f"job {job_id} has no TensorBoard files (tracking off for it, or on the"
                 " server)")
        out.append((f"job-{job_id}", Path(found[0].directory)))
    return out


def tensorboard(jobs: Annotated[list[int] | None, typer.Argument(
                    help="Job ids (default: every job).", show_default=False)] = None,
                server: ServerOpt = DEFAULT_SERVER,
                serve: Annotated[bool, typer.Option(
                    "--serve", help="Start TensorBoard on the directory instead of printing"
                    " it.")] = False,
                host: Annotated[str, typer.Option(
                    help="TensorBoard's bind address (--serve).")] = "127.0.0.1",
                port: Annotated[int, typer.Option(min=1, max=65535,
                                                  help="TensorBoard's port (--serve).")] = 6006
                ) -> None:
    """Print the TensorBoard log directory of jobs (or of every job), or start TensorBoard on
    it with --serve (on loopback unless --host says otherwise). The files are in the server's
    data directory: run this where the server runs.

    Example: trident tensorboard 12 15 --serve
    """
    with connect(server) as client:
        dirs = _dirs(client, list(jobs or []))
    if not serve:
        for _, d in dirs:
            typer.echo(d)
        return
    missing = [str(d) for _, d in dirs if not d.is_dir()]
    if missing:
        fail(f"{', '.join(missing)}: not on this machine (or no step exported yet); run"
             " `trident tensorboard` where the server's data directory is")
    exe = shutil.which("tensorboard", path=str(Path(sys.executable).parent)) or \
        shutil.which("tensorboard")
    if exe is None:
        fail("tensorboard is not installed here (pip install tensorboard)")
    spec = str(dirs[0][1]) if len(dirs) == 1 else ",".join(f"{n}:{d}" for n, d in dirs)
    flag = "--logdir" if len(dirs) == 1 else "--logdir_spec"
    typer.echo(f"TensorBoard on http://{host}:{port}/ ({spec}); Ctrl-C stops it", err=True)
    try:
        code = subprocess.call([exe, flag, spec, "--host", host, "--port", str(port)])
    except KeyboardInterrupt:
        code = 0
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add `trident compare` and `trident tensorboard` to the `trident` app."""
    app.command()(compare)
    app.command()(tensorboard)
