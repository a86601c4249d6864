"""`trident`: the command line. Every command talks to the REST API through
`client.TridentClient`, except `up` (starts the local stack), `controller` (runs the
controller alone), `bootstrap` (the first admin) and `plan` (needs no server); every error
is one line (`cli.common.Trident`). The API token comes from `TRIDENT_TOKEN`, a `trident login`
profile, or a local server's bootstrap token file (`client.token`); the identity commands
are in `cli.identity`, `submit`, `cancel` and `resubmit` in `cli.jobs`, `logs` and
`events` in `cli.logs`, `status`, `describe` and `top` in `cli.status`,
`cli.describe` and `cli.top`, `node` (starts this host's Ray node, no server) and
`cluster` in `cli.node`, `stacks` in `cli.stacks`, `profile` in `cli.profile`, `data`
(local: corpora) in `cli.data`, `goodput` in `cli.goodput`.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from cli import checkpoints as cli_checkpoints
from cli import describe as cli_describe
from cli import goodput as cli_goodput
from cli import jobs as cli_jobs
from cli import logs as cli_logs
from cli import status as cli_status
from cli import top as cli_top
from cli import tracking as cli_tracking
from cli.common import DEFAULT_SERVER, ServerOpt, Trident, connect, fail, short_helps
from cli.data import register as register_data
from cli.identity import open_database, register
from cli.node import register as register_node
from cli.offline import register_offline
from cli.profile import register as register_profile
from cli.stacks import register as register_stacks
from client.payloads import ProbeStatus, ProbeSummary
from service.contract.reports import ProbeRowModel

app = typer.Typer(cls=Trident, no_args_is_help=True,
                  help="Plan, run and watch TP x PP x DP (ZeRO) training jobs.")


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
       api_workers: Annotated[int, typer.Option(
           min=0, max=64, envvar="TRIDENT_API_WORKERS",
           help="API processes sharing the port, on the one database (0: the machine's"
           " cores, at most 4).")] = 0,
       stop_jobs: Annotated[bool, typer.Option(
           "--stop-jobs", help="On SIGTERM or Ctrl-C, stop running jobs too (by default they"
           " train on and the next `trident up` re-attaches them).")] = False) -> None:
    """Start the local stack: the API, the controller and (with no --ray-address) a local Ray
    head, each restarted whenever it exits. SIGTERM or Ctrl-C stops the API and the
    controller, and the head unless jobs are active, within TRIDENT_STOP_GRACE_S (30 s) of
    the signal whatever the database or Ray is doing; running jobs train on unless
    --stop-jobs. A data dir serves one `trident up`
    at a time: a second one on it exits, naming the pid that holds it. A --port in use is one
    line, before anything starts. A database it cannot read is one line (which, what is
    wrong, how to restore it) and exit status 1, before anything starts. --api-workers N
    runs N API processes on the one port and database (sessions, idempotency, log streams
    work across them); the controller stays one.

    Example: trident up --port 8000
    """
    import uvicorn

    from api.app import create_app
    from api.serve import PARENT_ENV, default_workers, reserve_port, serve
    from service.control.heap import freeze_startup_objects
    from service.settings import Settings

    env = dict(os.environ)
    if database_url:
        env["TRIDENT_DATABASE_URL"] = database_url
    if ray_address:
        env["TRIDENT_RAY_ADDRESS"] = ray_address
    if data_dir:
        env["TRIDENT_DATA_DIR"] = str(data_dir)
    env["TRIDENT_STOP_JOBS"] = "1" if stop_jobs else "0"
    # Where people reach the dashboard, for each MLflow run's link to its job (unless set).
    reach = socket.gethostname() if host in ("0.0.0.0", "::") else host
    env.setdefault("TRIDENT_PUBLIC_URL", f"http://{reach}:{port}")
    os.environ.update(env)
    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    from service.files.datadir import InUse, hold

    try:  # before any use: the data dir is this process's until it ends (kill -9 included)
        hold(settings.data_dir)
    except InUse as exc:
        fail(str(exc))
    except OSError as exc:  # a read-only or foreign directory
        fail(f"cannot lock data dir {settings.data_dir}: {exc.strerror or exc}")
    try:  # the API's port is checked, and kept from the Ray head's servers, until it serves
        reserved = reserve_port(host, port)
    except OSError as exc:
        fail(f"cannot serve the API on {host}:{port}: {exc.strerror or exc}; stop what holds"
             " it, or give this one another --port")
    open_database(settings)
    from cli.stopping import API_SHARE, Stop
    from service.cluster.rayhead import RayHead
    from service.cluster.supervisor import Supervisor

    # From here every SIGTERM or Ctrl-C is a stop that ends what was started within the grace
    # (`cli.stopping`), the head's start included.
    stop = Stop(settings.stop_grace_s, settings.db_url, stop_jobs)
    signal.signal(signal.SIGTERM, stop.signal)
    signal.signal(signal.SIGINT, stop.signal)
    try:
        if not settings.ray_address:
            # Its own supervised process, so that jobs outlive the controller and `trident up`.
            stop.head = head = RayHead(settings.data_dir)
            env.update(head.env())
            env["TRIDENT_RAY_ADDRESS"] = head.start()
            typer.echo(f"ray head at {head.address}"
                       f"{' (already running: adopted)' if head.adopted else ''}")
        log_path = settings.data_dir / "controller.log"
        env["TRIDENT_PARENT_PID"] = str(os.getpid())
        # The controller runs beside the API, in a process of its own, started again whenever
        # it exits (with backoff); it acts once it holds the lease.
        stop.controller = controller = Supervisor(
            [sys.executable, "-m", "service.control.daemon"], env=env, log_path=log_path,
            on_start=lambda pid: typer.echo(f"controller pid {pid} (log: {log_path})"))
        typer.echo(f"dashboard: http://{host}:{port}/   API: http://{host}:{port}/api/v1")
        workers = api_workers or default_workers()
        typer.echo(f"API: {workers} process(es)")
        controller.start()
        reserved.close()  # the API binds it now
        # uvicorn takes SIGTERM and SIGINT while it serves: the stop begins at its signal.
        graceful_s = max(1, int(API_SHARE * settings.stop_grace_s))  # uvicorn's are whole
        if workers > 1:
            # Processes of their own sharing the port (`api.serve`), each building the app
            # from the environment set above; each stops if this process is killed.
            os.environ[PARENT_ENV] = str(os.getpid())
            serve(host, port, workers, on_signal=stop.begin, graceful_s=graceful_s)
        else:

            class Server(uvicorn.Server):
                def handle_exit(self, sig: int, frame: Any) -> None:
                    stop.begin()
                    super().handle_exit(sig, frame)

            served = create_app(settings)
            freeze_startup_objects()  # full collections skip start-up's objects
            Server(uvicorn.Config(served, host=host, port=port, log_level="warning",
                                  timeout_graceful_shutdown=graceful_s)).run()
    finally:
        stop.finish()


@app.command()
def controller() -> None:
    """Run only the controller (no API), supervised: restarted with backoff whenever it exits,
    its log on stderr; settings from TRIDENT_* variables. One per container or host: the one
    that holds the lease acts, the others wait as standby. SIGTERM stops it cleanly. A
    database it cannot read is one line and exit status 1.

    Example: TRIDENT_DATABASE_URL=postgresql+psycopg://trident@db/trident trident controller
    """
    from service.cluster.supervisor import run_controller
    from service.settings import Settings
    from service.store.dbcheck import Unreadable, check

    try:
        settings = Settings()  # a bad setting is an error now, not a daemon restarted forever
    except ValidationError as exc:
        fail("; ".join((f"TRIDENT_{e['loc'][0]}: ".upper() if e["loc"] else "")
                       + str(e["msg"]).removeprefix("Value error, ") for e in exc.errors()))
    settings.data_dir.mkdir(parents=True, exist_ok=True)  # so is a data dir it cannot make
    try:  # so is a database it cannot read
        if note := check(settings.db_url):
            typer.echo(note, err=True)
    except Unreadable as exc:
        fail(str(exc), 1)
    raise typer.Exit(run_controller(dict(os.environ)))


@app.command()
def probe(server: ServerOpt = DEFAULT_SERVER,
          ranks_per_node: Annotated[int, typer.Option(min=1, max=64, help=(
              "Ranks per node: its GPUs, or CPU ranks sharing its cores."))] = 2,
          max_bytes: Annotated[int, typer.Option(min=1024, max=1 << 30,
                                                 help="Largest message.")] = 64 << 20,
          profile: Annotated[str, typer.Option(help="Profile to calibrate.")] = "cpu",
          timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 600,
          calibrate: Annotated[bool, typer.Option(
              "--calibrate", help="Then run the calibration jobs (a few steps of the trainer"
              " at three sizes, one after another) and store the trident stack's efficiency"
              " and overheads fitted to them with the profile.")] = False) -> None:
    """Measure matmul FLOP/s and collective bandwidth on the live cluster; the result
    calibrates the profile the planner uses for jobs on it. With --calibrate, the planner's
    step-time constants of the trident stack are measured too (`trident plan --json`
    marks them `measured`).

    Example: trident probe --ranks-per-node 8 --profile h100-80gb --calibrate
    """
    with connect(server) as client:
        p = client.request_probe(ranks_per_node=ranks_per_node, max_bytes=max_bytes,
                                 profile=profile)
        typer.echo(f"probe {p.id} requested; waiting for the controller")
        deadline = time.monotonic() + timeout
        while p.status in (ProbeStatus.PENDING, ProbeStatus.RUNNING):
            if time.monotonic() > deadline:
                fail(f"probe {p.id} still {p.status.value} after {timeout:g} s", 1)
            time.sleep(1)
            p = client.get_probe(p.id)
    if p.status != ProbeStatus.DONE:
        fail(f"probe {p.id} failed: {p.error}", 1)
    s = ProbeSummary.of(p)
    typer.echo(f"{s.ranks} ranks on {s.nodes} node(s)")
    for kind, flops in sorted(s.matmul_flops.items()):
        typer.echo(f"  matmul {kind}: {flops / 1e12:.3f} TFLOP/s per rank")
    for link, bw in sorted(s.links.items()):
        if bw:
            typer.echo(f"  {link}: {bw / 1e9:.2f} GB/s (all-reduce busbw)")
    typer.echo(f"  {'op':<14} {'group':<10} {'bytes':>10} {'busbw GB/s':>11}")
    for row in (ProbeRowModel.model_validate(r) for r in p.results):
        typer.echo(f"  {row.op:<14} {str(row.group):<10} {row.bytes:>10}"
                   f" {row.busbw / 1e9:>11.3f}")
    typer.echo(f"profile {s.profile.name!r} calibrated; new plans on this cluster use it")
    if calibrate:
        with connect(server) as client:
            calibration_jobs(client, profile, time.monotonic() + timeout)


def calibration_jobs(client: Any, profile: str, deadline: float) -> None:
    """Run the calibration jobs of `profile` one after another (so that none times another's
    steps), then have the server fit and store the stack's constants."""
    from service.contract.hardware import get_profile
    from service.planner.calibrate import calibration_specs

    ids = []
    for spec in calibration_specs(get_profile(profile)):
        job = client.submit(spec)
        typer.echo(f"calibration job {job.id} ({spec['name']}) submitted")
        while not job.state.terminal:
            if time.monotonic() > deadline:
                client.cancel_job(job.id)
                fail(f"calibration job {job.id} still {job.state.value} at the timeout;"
                     " cancelled", 1)
            time.sleep(1)
            job = client.get_job(job.id)
        if job.state.value != "SUCCEEDED":
            fail(f"calibration job {job.id} ended {job.state.value}: {job.error}", 1)
        ids.append(job.id)
    out = client.calibrate(profile=profile, jobs=ids).model_dump()
    cal = out["calibration"]
    typer.echo(f"stack {cal['stack']}: efficiency {cal['efficiency']:.3f} of the probed GEMM"
               f" rate, overheads {1e3 * out['layer_overhead_s']:.2f} ms per layer and"
               f" micro-batch, {1e3 * out['step_overhead_s']:.2f} ms per step; fit error"
               f" {100 * cal['error']:.1f}% (jobs {', '.join(map(str, ids))})")
    typer.echo(f"profile {profile!r}: plans on this cluster mark these constants measured")


register(app)
register_offline(app)
cli_status.register(app)
cli_describe.register(app)
cli_top.register(app)
register_node(app)
register_stacks(app)
register_profile(app)
register_data(app)
cli_jobs.register(app)
cli_logs.register(app)
cli_tracking.register(app)
cli_checkpoints.register(app)
cli_goodput.register(app)
short_helps(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
