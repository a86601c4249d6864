"""Test helper: run `train_rank` on N local processes (gloo) and collect every rank's reports.
The processes are forked from a server that imported the trainer (`tests.forked`)."""

from __future__ import annotations

import os
import queue as queue_mod
import random
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.contract.reports import StepReport
from service.contract.spec import JobSpec
from service.files.checkpoint_dirs import CheckpointWriter
from service.files.order_cache import OrderCache, ServerData
from tests import forked
from tests.servers import free_port

TEST_SERVER = ServerData(
    OrderCache(Path(tempfile.gettempdir()) / f"trident-test-orders-{os.getuid()}",
               user_bytes=1 << 30, total_bytes=2 << 30), data_roots=("/",))
"""The data rules of ranks run without a controller: a sample-order cache shared by the test
runs of this user (bounded: its least recently used orders go), corpora anywhere."""
RENDEZVOUS_LOW = 20000
"""The lowest rendezvous port drawn (`_rendezvous_ports`): above Ray's worker ports
(10002-19999 by default)."""


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 by default on Linux)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _rendezvous_ports(n: int) -> list[int]:
    """`n` distinct ports, free now, one per attempt, drawn below the kernel's ephemeral range
    where it leaves room. A later attempt listens on its port many seconds after the ranks
    start; a port of the ephemeral range (every connect, every bind to port 0 on the machine
    draws from it) could be another process's by then, and was (EADDRINUSE at attempt 2
    while the other xdist worker ran). Below it, only a port that some process asks for by
    number can be taken."""
    low, high = RENDEZVOUS_LOW, _ephemeral_low()
    ports: list[int] = []
    while len(ports) < n:
        port = random.randrange(low, high) if high - low >= 1000 else free_port()
        if port not in ports and _free(port):
            ports.append(port)
    return ports


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _rank_main(spec_json: str, rank: int, world: int, ports: list[int], ckpt: str | None,
               attempts: list[int | None], stop_ranks: list[int] | None, queue: Any,
               writer: CheckpointWriter | None = None, preempt: bool = False,
               server: ServerData | None = None) -> None:
    import torch

    torch.set_num_threads(1)
    if os.environ.get("TRIDENT_TEST_HANG_DUMP_S"):  # debugging aid: stacks of a hung rank
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["TRIDENT_TEST_HANG_DUMP_S"]),
                                          exit=True)
    spec = JobSpec.model_validate_json(spec_json)
    if spec.resources.gpus_per_worker == 0:
        os.environ["DS_ACCELERATOR"] = "cpu"
    from workers.rank.faults import FaultInjector
    from workers.trainer.train import RankContext, planned_row, train_rank

    try:
        # Several attempts in one process, as a Ray actor may run them; an attempt with a
        # stop step sets `stop` after that step's report.
        for attempt, stop_after in enumerate(attempts):
            stop = threading.Event()
            save_now = threading.Event()

            def report(r: StepReport, attempt: int = attempt, stop_after=stop_after,
                       stop: threading.Event = stop,
                       save_now: threading.Event = save_now) -> None:
                queue.put(("report", rank, attempt, r.model_dump()))
                if stop_after is not None and r.step >= stop_after and \
                        (stop_ranks is None or rank in stop_ranks):
                    if preempt:  # as `RankActor.preempt` does
                        save_now.set()
                    stop.set()

            # The job's nan and spike faults, as the rank actor gives them (attempts count
            # from 1 there).
            faults = FaultInjector(rank, attempt + 1, spec.faults)
            ctx = RankContext(rank=rank, world_size=world, local_rank=rank,
                              master_addr="127.0.0.1", master_port=ports[attempt],
                              checkpoint_dir=ckpt, plan=planned_row(spec, rank),
                              attempt=attempt, writer=writer, save_now=save_now,
                              server=server or TEST_SERVER,
                              loss_factor=faults.loss_factor if faults.faults else None)
            # On a thread, as the Ray actor runs it; its exception is re-raised here.
            failure: list[BaseException] = []

            def started(step: int, attempt: int = attempt) -> None:
                queue.put(("start", rank, attempt, step))

            def run(ctx: RankContext = ctx, report=report, stop: threading.Event = stop,
                    failure: list[BaseException] = failure) -> None:
                try:
                    train_rank(spec, ctx, report, stop, started)
                except BaseException as exc:
                    failure.append(exc)

            thread = threading.Thread(target=run, name=f"rank{rank}-attempt{attempt}")
            thread.start()
            thread.join()
            if failure:
                raise failure[0]
        queue.put(("done", rank, None, None))
    except BaseException:
        queue.put(("error", rank, None, traceback.format_exc()))


def run_ranks(spec: JobSpec, *, checkpoint_dir: str | None = None,
              attempts: list[int | None] | None = None, stop_ranks: list[int] | None = None,
              timeout: float = 240, writer: CheckpointWriter | None = None,
              preempt: bool = False,
              sequence: list[tuple[int, str, int]] | None = None,
              server: ServerData | None = None,
              target: Callable[..., None] | None = None) -> list[list[dict]]:
    """Reports per attempt, in arrival order; raises with the traceback of a failed rank.

    `attempts` runs several attempts in the same processes; an attempt's number is the step
    after which `stop` is set (None: run to the end), on `stop_ranks` only if given. `writer`:
    the job the checkpoint folder must belong to, as the controller gives it. `preempt`:
    stopping an attempt also asks its ranks to save first, as a preemption does.
    `sequence`, if given, receives `(rank, "start" or "report", step)` in each rank's order:
    the trainer's `step_started` calls and its reports. `server`: the data rules the ranks
    get (default `TEST_SERVER`). `target`: each rank's function in place of `_rank_main`,
    called with its arguments (`tests.unfused.rank_main`: the trainer of before a change).
    """
    attempts = attempts or [None]
    world = spec.world_size
    ctx = forked.context()
    queue = ctx.Queue()
    ports = _rendezvous_ports(len(attempts))  # a fresh rendezvous port per attempt
    procs = [forked.process(ctx, target or _rank_main,
                            (spec.model_dump_json(exclude_unset=True), r, world, ports,
                             checkpoint_dir, attempts, stop_ranks, queue, writer, preempt,
                             server))
             for r in range(world)]
    for p in procs:
        p.start()
    out: list[list[dict]] = [[] for _ in attempts]
    done = 0
    deadline = time.monotonic() + timeout
    try:
        while done < world:
            try:
                kind, rank, attempt, payload = queue.get(timeout=1)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {dead} died or timed out") from None
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            if kind == "done":
                done += 1
            elif kind == "start":
                if sequence is not None:
                    sequence.append((rank, "start", payload))
            else:
                out[attempt].append(payload)
                if sequence is not None:
                    sequence.append((rank, "report", payload["step"]))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out


def each_step(rows: list[dict], rank: int = 0) -> list[dict]:
    """`rank`'s reports in step order, each step once: a step reported twice (a save written
    in the background and waited for after it, at a stop or the end of training, is reported
    again with its tag) counts by its first report."""
    first: dict[int, dict] = {}
    for r in rows:
        if r["rank"] == rank:
            first.setdefault(r["step"], r)
    return [first[s] for s in sorted(first)]


def losses(rows: list[dict], rank: int = 0) -> list[float]:
    """`rank`'s loss of each step, in step order (`each_step`)."""
    return [r["loss"] for r in each_step(rows, rank)]
