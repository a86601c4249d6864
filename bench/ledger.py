"""What a goodput ledger costs to read, against the length of the job: the ledger of a running
job of three attempts with `--small` steps and one with `--large` steps, in one store, read
alternately (A B B A ...). The ledger reads each attempt's first and last steps by index
seeks and sums only the steps that evaluated or saved (`ix_step_metrics_extras`), so its cost
grows with those (here an evaluation every 100 steps, a save every 1,000), not with the steps;
a ledger that read every step would grow with them (`--large / --small` times).

    python -m bench.ledger                      # SQLite, 10,000 and 1,000,000 steps
    python -m bench.ledger --db postgres        # the local PostgreSQL (a database of its own)

And what `GET /metrics`' goodput counters cost with a history of ended jobs (every ledger
summed at each scrape; the first computes and keeps them on their rows):

    python -m bench.ledger --scrape 1000        # 1,000 ended jobs, three scrapes
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import create_engine, insert, text, update

from bench.harness import alternate, fmt_s
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.store import AttemptStatus, Store
from service.store.goodput import GoodputLedger
from service.store.tables import JobRow, StepMetricRow
from service.submission.intake import submit

PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SCRATCH = "trident_bench_ledger"
SPEC = {"name": "long", "model": {"preset": "gpt-tiny"},
        "train": {"steps": 10_000_000, "global_batch": 8, "micro_batch": 2,
                  "precision": "fp32"},
        "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 2},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5}}


def job_of(store: Store, steps: int) -> int:
    """A running job of three attempts (two failed) and `steps` stored steps, 0.1 s apart."""
    job = submit(store, JobSpec.model_validate(SPEC))
    per = steps // 3
    t0 = datetime.now(UTC) - timedelta(seconds=steps * 0.1 + 60)
    done = 0
    for attempt in (1, 2, 3):
        store.start_attempt(job_id=job.id)
        store.transition(job_id=job.id, to=JobState.PLACING, message="admitted",
                         attempt=attempt)
        store.transition(job_id=job.id, to=JobState.RUNNING, message="running",
                         attempt=attempt)
        first = max(1, done - 50)  # each restart redoes 50 steps
        rows = [{"job_id": job.id, "attempt": attempt, "step": n, "ranks": 2, "world_size": 2,
                 "rank_bits": None, "loss": 1.0, "step_time_sum": 0.18,
                 "step_time_sumsq": 0.0162, "step_time_min": 0.09, "step_time_max": 0.09,
                 "worst_rank": 1, "tokens_per_s": 1.0, "stragglers": 0,
                 "time": t0 + timedelta(seconds=0.1 * n), "ended_at": t0 +
                 timedelta(seconds=0.1 * n), "eval_s": 0.01 if n % 100 == 0 else None,
                 "save_s": 0.02 if n % 1000 == 0 else None,
                 "resumed_from": (first - 1) // 1000 * 1000}
                for n in range(first, first + per)]
        with store._tx() as s:
            for i in range(0, len(rows), 50_000):
                s.execute(insert(StepMetricRow), rows[i:i + 50_000])
        done = first + per - 1
        if attempt < 3:
            store.end_attempt(job_id=job.id, number=attempt, status=AttemptStatus.FAILED,
                              error="boom")
            store.transition(job_id=job.id, to=JobState.RESTARTING, message="failed",
                             attempt=attempt)
    return job.id


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    p.add_argument("--small", type=int, default=10_000)
    p.add_argument("--large", type=int, default=1_000_000)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--scrape", type=int, default=0, metavar="JOBS",
                   help="time /metrics' goodput counters over this many ended jobs instead")
    args = p.parse_args()
    if args.scrape:
        scrape(args.scrape)
        return
    with tempfile.TemporaryDirectory() as tmp:
        url = scratch_pg() if args.db == "postgres" else f"sqlite:///{Path(tmp) / 'ledger.db'}"
        store = Store(url)
        store.migrate()
        t = time.perf_counter()
        small, large = job_of(store, args.small), job_of(store, args.large)
        print(f"loaded {args.small + args.large:,} steps in {time.perf_counter() - t:.1f} s")
        ledgers = GoodputLedger(store)

        def read(job_id: int) -> float:
            t0 = time.perf_counter()
            ledgers.ledger(job_id)
            return time.perf_counter() - t0

        a, b = alternate(lambda: read(small), lambda: read(large), args.reps)
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{args.db}: ledger of {args.small:,} steps {fmt_s(ma)}, of {args.large:,} steps"
              f" {fmt_s(mb)} (medians of {args.reps}, alternated): ratio {mb / ma:.2f}"
              f" for {args.large / args.small:.0f} times the steps")
        store.close()
        if args.db == "postgres":
            scratch_pg(drop=True)


def scrape(n: int) -> None:
    from api.prometheus import StoreCollector

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{Path(tmp) / 'scrape.db'}")
        store.migrate()
        spec = JobSpec.model_validate(SPEC)
        for _ in range(n):
            job = submit(store, spec)
            store.start_attempt(job_id=job.id)
            store.transition(job_id=job.id, to=JobState.PLACING, message="admitted", attempt=1)
            store.transition(job_id=job.id, to=JobState.RUNNING, message="running", attempt=1)
            store.end_attempt(job_id=job.id, number=1, status=AttemptStatus.SUCCEEDED)
            store.transition(job_id=job.id, to=JobState.SUCCEEDED, message="done", attempt=1)
        with store._tx() as s:  # ended long enough ago for their ledgers to be kept
            s.execute(update(JobRow).values(finished_at=datetime.now(UTC) - timedelta(hours=1)))
        collector = StoreCollector(lambda: store, per_rank=False)
        for k in range(3):
            t = time.perf_counter()
            list(collector._goodput(store))
            print(f"{n:,} ended jobs, scrape {k + 1}: goodput counters"
                  f" {fmt_s(time.perf_counter() - t)}")
        store.close()


def scratch_pg(drop: bool = False) -> str:
    """A database of its own on the local PostgreSQL (made afresh; dropped with `drop`)."""
    admin = create_engine(PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f"DROP DATABASE IF EXISTS {SCRATCH} WITH (FORCE)"))
        if not drop:
            c.execute(text(f"CREATE DATABASE {SCRATCH}"))
    admin.dispose()
    return PG.rsplit("/", 1)[0] + "/" + SCRATCH


if __name__ == "__main__":
    main()
