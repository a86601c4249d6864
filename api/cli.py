"""`trident`: the command line. Every command talks to the REST API, except `up` (starts the
local stack), `controller` (runs the controller alone), `bootstrap` (the first admin) and
`plan` (needs no server). The API token comes from `TRIDENT_TOKEN`, a `trident login`
profile, or a local server's bootstrap token file (`api.cli_auth`); the identity commands
are in `api.cli_identity`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from api import cli_jobs, cli_logs
from api.cli_common import DEFAULT_SERVER, ServerOpt, _call, fail
from api.cli_identity import announce_bootstrap, register
from api.cli_offline import register_offline
from service.planner.stored import StoredPlan

app = typer.Typer(no_args_is_help=True,
                  help="Plan, run and watch TP x PP x DP (ZeRO) training jobs.")


def _layout(plan: dict[str, Any]) -> str:
    """A job's layout from the REST JSON of its plan, e.g. `tp1 pp1 dp2 zero2`."""
    return StoredPlan.from_json(plan).layout.label


@app.command()
def status(job_id: Annotated[int | None, typer.Argument()] = None,
           server: ServerOpt = DEFAULT_SERVER,
           owner: Annotated[str | None, typer.Option(help="Only this user's jobs.")] = None
           ) -> None:
    """List jobs (with their owner and project), or show one job in detail."""
    if job_id is None:
        params: dict[str, Any] = {"limit": 50, **({"owner": owner} if owner else {})}
        jobs = _call(server, "GET", "/jobs", params=params)
        typer.echo(f"{'ID':>5}  {'STATE':<10}  {'RANKS':>5}  {'LAYOUT':<18}  {'OWNER':<12}"
                   f"  {'PROJECT':<12}  NAME")
        for j in jobs["items"]:
            typer.echo(f"{j['id']:>5}  {j['state']:<10}  {j['world_size']:>5}"
                       f"  {_layout(j['plan']):<18}  {j['owner']:<12}  {j['project'] or '-':<12}"
                       f"  {j['name']}")
        return
    j = _call(server, "GET", f"/jobs/{job_id}")
    metrics = _call(server, "GET", f"/jobs/{job_id}/metrics")["items"]
    typer.echo(f"job {j['id']} {j['name']}: {j['state']}  ({j['world_size']} ranks,"
               f" {_layout(j['plan'])}, attempts {j['attempts']})")
    if metrics:
        m = metrics[-1]
        typer.echo(f"last step {m['step']}: loss {m['loss']}, {m['step_time_s']:.3f} s/step,"
                   f" {m['tokens_per_s']:.0f} tokens/s")
    pvm = j.get("predicted_vs_measured") or {}
    for key, unit in (("step_s", "s/step"), ("tokens_per_s", "tokens/s"),
                      ("model_state_bytes", "bytes of model states")):
        row = pvm.get(key) or {}
        if row.get("predicted") is not None:
            meas = "-" if row.get("measured") is None else f"{row['measured']:.4g}"
            ratio = "" if row.get("ratio") is None else f"  (measured/predicted {row['ratio']:.2f})"
            typer.echo(f"{unit:>22}: predicted {row['predicted']:.4g}, measured {meas}{ratio}")
    if j.get("waiting"):
        typer.echo(j["waiting"])
    if j["error"]:
        typer.echo(f"error: {j['error']}")


@app.command()
def up(host: Annotated[str, typer.Option(help="API bind address.")] = "127.0.0.1",
       port: Annotated[int, typer.Option(min=1, max=65535, help="API port.")] = 8000,
       database_url: Annotated[str, typer.Option(envvar="TRIDENT_DATABASE_URL",
                                                 help="SQLAlchemy URL; default SQLite.")] = "",
       ray_address: Annotated[str, typer.Option(envvar="TRIDENT_RAY_ADDRESS",
                                                help="Existing Ray cluster; default local.")]
       = "",
       data_dir: Annotated[Path | None, typer.Option(envvar="TRIDENT_DATA_DIR",
                                                     help="Database, checkpoints, logs.")]
       = None,
       stop_jobs: Annotated[bool, typer.Option(
           "--stop-jobs", help="On SIGTERM or Ctrl-C, stop running jobs too (by default they"
           " train on and the next `trident up` re-attaches them).")] = False) -> None:
    """Start the local stack: the API, the controller and (with no --ray-address) a local Ray
    head, each restarted whenever it exits. SIGTERM or Ctrl-C stops the API and the
    controller; running jobs train on unless --stop-jobs.

    Example: trident up --port 8000
    """
    import uvicorn

    from api.app import create_app
    from service.settings import Settings

    env = dict(os.environ)
    if database_url:
        env["TRIDENT_DATABASE_URL"] = database_url
    if ray_address:
        env["TRIDENT_RAY_ADDRESS"] = ray_address
    if data_dir:
        env["TRIDENT_DATA_DIR"] = str(data_dir)
    env["TRIDENT_STOP_JOBS"] = "1" if stop_jobs else "0"
    os.environ.update(env)
    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    from migrations import upgrade

    upgrade(settings.db_url)
    if settings.env != "prod":
        announce_bootstrap(settings)
    from service.rayhead import RayHead
    from service.supervisor import Supervisor

    head = None
    if not settings.ray_address:
        # Its own supervised process, so that jobs outlive the controller and `trident up`.
        head = RayHead(settings.data_dir)
        env.update(head.env())
        env["TRIDENT_RAY_ADDRESS"] = head.start()
        typer.echo(f"ray head at {head.address}"
                   f"{' (already running: adopted)' if head.adopted else ''}")
    log_path = settings.data_dir / "controller.log"
    env["TRIDENT_PARENT_PID"] = str(os.getpid())
    # The controller runs beside the API, in a process of its own, started again whenever it
    # exits (with backoff); it acts once it holds the lease.
    controller = Supervisor([sys.executable, "-m", "service.daemon"], env=env,
                            log_path=log_path,
                            on_start=lambda pid: typer.echo(f"controller pid {pid}"
                                                            f" (log: {log_path})"))
    typer.echo(f"dashboard: http://{host}:{port}/   API: http://{host}:{port}/api/v1")
    # uvicorn re-raises SIGTERM after its graceful shutdown; turn it into an exit so that the
    # `finally` below stops the controller instead of leaving it orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    controller.start()
    try:
        uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")
    finally:
        controller.stop(30)
        if head is not None:
            _stop_head(head, settings, stop_jobs)


def _stop_head(head: Any, settings: Any, stop_jobs: bool) -> None:
    """Stop the local Ray head, unless jobs are still active on it (they train on, and the
    next `trident up` adopts the head and re-attaches them)."""
    from service.store import Store

    store = Store(settings.db_url)
    try:
        active = [] if stop_jobs else store.active_jobs()
    finally:
        store.close()
    if active:
        typer.echo(f"{len(active)} job(s) still active keep the Ray head at {head.address}"
                   " running; `trident up` re-attaches them (--stop-jobs stops them)")
        return
    head.stop()


@app.command()
def controller() -> None:
    """Run only the controller (no API), supervised: restarted with backoff whenever it exits,
    its log on stderr; settings from TRIDENT_* variables. One per container or host: the one
    that holds the lease acts, the others wait as standby. SIGTERM stops it cleanly.

    Example: TRIDENT_DATABASE_URL=postgresql+psycopg://trident@db/trident trident controller
    """
    from service.settings import Settings
    from service.supervisor import run_controller

    try:
        Settings()  # a bad setting is an error now, not a daemon restarted forever
    except ValidationError as exc:
        fail("; ".join((f"TRIDENT_{e['loc'][0]}: ".upper() if e["loc"] else "")
                       + str(e["msg"]).removeprefix("Value error, ") for e in exc.errors()))
    raise typer.Exit(run_controller(dict(os.environ)))


@app.command()
def probe(server: ServerOpt = DEFAULT_SERVER,
          ranks_per_node: Annotated[int, typer.Option(min=1, max=64, help=(
              "Ranks per node: its GPUs, or CPU ranks sharing its cores."))] = 2,
          max_bytes: Annotated[int, typer.Option(min=1024, max=1 << 30,
                                                 help="Largest message.")] = 64 << 20,
          profile: Annotated[str, typer.Option(help="Profile to calibrate.")] = "cpu",
          timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 600) -> None:
    """Measure matmul FLOP/s and collective bandwidth on the live cluster; the result
    calibrates the profile the planner uses for jobs on it.

    Example: trident probe --ranks-per-node 8 --profile h100-80gb
    """
    p = _call(server, "POST", "/probes", json={"ranks_per_node": ranks_per_node,
                                               "max_bytes": max_bytes, "profile": profile})
    typer.echo(f"probe {p['id']} requested; waiting for the controller")
    deadline = time.monotonic() + timeout
    while p["status"] in ("pending", "running"):
        if time.monotonic() > deadline:
            fail(f"probe {p['id']} still {p['status']} after {timeout:g} s", 1)
        time.sleep(1)
        p = _call(server, "GET", f"/probes/{p['id']}")
    if p["status"] != "done":
        fail(f"probe {p['id']} failed: {p['error']}", 1)
    s = p["summary"]
    typer.echo(f"{s['ranks']} ranks on {s['nodes']} node(s)")
    for kind, flops in sorted(s["matmul_flops"].items()):
        typer.echo(f"  matmul {kind}: {flops / 1e12:.3f} TFLOP/s per rank")
    for link, bw in sorted(s["links"].items()):
        if bw:
            typer.echo(f"  {link}: {bw / 1e9:.2f} GB/s (all-reduce busbw)")
    typer.echo(f"  {'op':<14} {'group':<10} {'bytes':>10} {'busbw GB/s':>11}")
    for row in p["results"]:
        typer.echo(f"  {row['op']:<14} {str(row['group']):<10} {row['bytes']:>10}"
                   f" {row['busbw'] / 1e9:>11.3f}")
    typer.echo(f"profile {s['profile']['name']!r} calibrated; new plans on this cluster use it")


@app.command()
def cluster(server: ServerOpt = DEFAULT_SERVER) -> None:
    """The live cluster's nodes, as the controller last saw them."""
    c = _call(server, "GET", "/cluster")
    for n in c["nodes"]:
        info = n["info"]
        what = (f"{len(info.get('gpus') or [])} x {info.get('gpu_model')}"
                if info.get("accelerator") == "gpu" else f"CPU, {info.get('cpus')} cores")
        typer.echo(f"{n['node_id'][:12]}  {n['hostname']:<20} {'alive' if n['alive'] else 'dead'}"
                   f"  {what}")
    for name, p in c["profiles"].items():
        typer.echo(f"profile {name}: calibrated by probe {p.get('probe_id')}")


register(app)
register_offline(app)
cli_jobs.register(app)
cli_logs.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
