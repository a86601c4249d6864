"""Tracking: how fast the exporter sends a job's stored steps, and what it costs the
controller's pass while a tracker hangs.

- Throughput: a job of 8 ranks (tp1 pp2 dp4) with N steps stored as the controller stores them
  (`MetricsIngest`), sent by `Exporter` rounds until caught up, to TensorBoard files and to a
  real `mlflow server` (SQLite, loopback); steps/s and values/s.
- The pass: `Exporter.step()` called every 10 ms (as the controller's pass calls it) while
  its round waits on an MLflow server that accepts connections and never answers (MLflow's
  client gives up after its 10 s time-out): each call's duration. Goal: p99 under 1 ms, i.e.
  a hung tracker costs a pass nothing.

`python -m bench.tracking [--quick]` prints the figures; `python -m bench.run --only
tracking` puts them in the report.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import Section, dist, fmt_dist

PASS_GOAL_S = 1e-3


def _job(store: Any, cfg: Any, steps: int) -> Any:
    from service.contract.reports import StepReport
    from service.contract.spec import JobSpec
    from service.contract.states import JobState
    from service.store.metrics import MetricsIngest
    from service.submission.intake import Submitter, submit

    spec = JobSpec.model_validate({
        "name": "bench-tracking", "model": {"preset": "gpt-tiny"},
        "train": {"steps": steps, "global_batch": 8, "micro_batch": 1, "precision": "fp32"},
        "parallel": {"tp": 1, "pp": 2, "dp": 4}, "resources": {"cpus_per_worker": 0.5}})
    job = submit(store, spec, by=Submitter(owner="bench", tracking=cfg))
    store.start_attempt(job_id=job.id)
    store.transition(job_id=job.id, to=JobState.PLACING, message="bench")
    store.transition(job_id=job.id, to=JobState.RUNNING, message="bench")
    ingest = MetricsIngest(store)
    comm = {"dp": {"all_reduce": {"time_s": 0.01, "bytes": 1e6, "calls": 2.0}},
            "pp": {"send": {"time_s": 0.005, "bytes": 1e5, "calls": 4.0}}}
    for s in range(1, steps + 1, 50):
        ingest.record(job_id=job.id, attempt=1, world_size=8, rows=[
            StepReport(rank=r, step=k, loss=5.0 / k, step_time_s=0.1, tokens_per_s=2560.0,
                       memory={"process_peak_bytes": 10**9, "params_bytes": 10**8},
                       comm=comm, bubble_s=0.01, custom={"accuracy": k / steps}).row()
            for k in range(s, min(s + 50, steps + 1)) for r in range(8)])
    return store.transition(job_id=job.id, to=JobState.SUCCEEDED, message="bench")


def _throughput(store: Any, cfg: Any, job: Any, kind: Any) -> tuple[float, int]:
    from service.store.tracking_exports import Exports
    from service.tracking.exporter import Exporter

    exporter = Exporter(store, cfg.make_sink, allowed=cfg.allows, settle_s=0)
    t0 = time.perf_counter()
    while not Exports(store).get(job_id=job.id, sink=kind).done:  # type: ignore[union-attr]
        exporter.cycle()
    seconds = time.perf_counter() - t0
    exporter.close()
    e = Exports(store).get(job_id=job.id, sink=kind)
    assert e is not None and e.dropped == 0
    return seconds, e.exported


class _Silent:
    """A TCP server that accepts connections and never answers (a hung tracker)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


def run(sec: Section, quick: bool, dbs: tuple[str, ...] = ()) -> None:
    from service.store import Store
    from service.store.tracking_exports import Sink
    from service.tracking.config import TrackingConfig
    from service.tracking.exporter import Exporter
    from tests.mlflow_server import MlflowServer

    steps = 400 if quick else 4000
    tmp = Path(tempfile.mkdtemp(prefix="trident-bench-tracking-"))
    store = Store(f"sqlite:///{tmp / 'trident.db'}")
    store.migrate()
    server = MlflowServer(tmp / "mlflow")
    (tmp / "mlflow").mkdir()
    server.start()
    try:
        only = {Sink.TENSORBOARD: TrackingConfig(tensorboard_root=tmp / "tensorboard"),
                Sink.MLFLOW: TrackingConfig(mlflow_uri=server.uri,
                                            mlflow_allowed=frozenset({server.uri}))}
        for kind, cfg in only.items():  # a job for each: its one tracker
            job = _job(store, cfg, steps)
            seconds, exported = _throughput(store, cfg, job, kind)
            from service.store.metrics import MetricsIngest
            from service.tracking.scalars import first_rank_of_stages, scalars_of

            rows = MetricsIngest(store).rows_after(
                job_id=job.id, after=(0, 0), limit=1,
                ranks=sorted(first_rank_of_stages(job.plan).values()))
            values = len(scalars_of(rows, job.plan)[0].values)
            sec.figures[kind.value] = {"steps": exported, "seconds": seconds,
                                       "values_per_step": values,
                                       "steps_per_s": exported / seconds}
            sec.row(f"export to {kind.value}: {exported} steps of an 8-rank job",
                    f"{exported / seconds:.0f} steps/s",
                    f"{values} values a step, {exported * values / seconds:.0f} values/s")
    finally:
        server.kill()

    silent = _Silent()
    try:
        uri = f"http://127.0.0.1:{silent.port}"
        hung = TrackingConfig(mlflow_uri=uri, mlflow_allowed=frozenset({uri}))
        job = _job(store, hung, 20)
        exporter = Exporter(store, hung.make_sink, allowed=hung.allows, every_s=0)
        passes = []
        deadline = time.monotonic() + (5 if quick else 20)
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            exporter.step()
            passes.append(time.perf_counter() - t0)
            time.sleep(0.01)
        exporter.close(wait_s=0)
    finally:
        silent.close()
    d = dist(passes)
    sec.figures["pass_while_hung"] = {"seconds": d, "held_connections": len(silent.held)}
    sec.row("Exporter.step() in a controller pass, MLflow hung", fmt_dist(d),
            f"{d['n']} passes; the round waits on its own thread")
    sec.goal("a pass's exporter call while the tracker hangs, p99 (s)", d["p99"],
             f"< {PASS_GOAL_S:g}", d["p99"] < PASS_GOAL_S)
    store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sec = Section("tracking", "Tracking export")
    run(sec, args.quick)
    for what, headline, detail in sec.rows:
        print(f"{what}: {headline} ({detail})")
    for g in sec.goals:
        print(f"goal {g.name}: {g.value} {g.target} -> {'met' if g.met else 'NOT met'}")


if __name__ == "__main__":
    main()
