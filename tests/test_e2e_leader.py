"""Two controllers (`trident controller`, each a supervised daemon, as the compose stack runs
it), real processes, against one database (SQLite and PostgreSQL) and one Ray cluster: only the
lease holder acts, the other waits as standby without touching a job; after kill -9 of the
leader's daemon a standby (the other controller's, or the one its supervisor starts again)
takes the lease once it expires, re-attaches to the job's ranks (no attempt is started twice,
no retry is used), and the job succeeds with every step of every rank stored exactly once. The
ranks are light (`program: light`, `workers.rank.light`): what is tested is the hand-over."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from service.cluster.rayhead import RayHead
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.store import Store
from service.store.lease import CONTROLLER, Lease, Leases
from service.store.tables import utcnow
from service.submission.intake import submit
from tests.conftest import tiny_spec
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STEPS = 40
LEASE_S = 6.0
"""Long enough for a daemon to connect to Ray (seconds on a loaded machine) within it."""


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    """One Ray head for the module, as `trident up` runs it (its own supervised process)."""
    head = RayHead(tmp_path_factory.mktemp("ray-head"))
    head.start()
    yield head
    head.stop()


class Daemon:
    """`trident controller` (the daemon under its supervisor), in its own session."""

    def __init__(self, name: str, data_dir: Path, db_url: str, head: RayHead) -> None:
        self.log_path = data_dir / f"{name}.log"
        env = {**os.environ, **head.env(), "PYTHONPATH": str(ROOT),
               "TRIDENT_DATA_DIR": str(data_dir), "TRIDENT_DATABASE_URL": db_url,
               "TRIDENT_RAY_ADDRESS": head.address, "TRIDENT_LEASE_S": str(LEASE_S),
               "TRIDENT_POLL_INTERVAL_S": "0.2", "TRIDENT_LIGHT_RANKS": "1"}
        env.pop("TRIDENT_PARENT_PID", None)
        with self.log_path.open("w") as out:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "trident"), "controller"], env=env,
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def daemon_pid(self) -> int | None:
        """The pid of the daemon its supervisor started last."""
        started = re.findall(r"controller pid (\d+) started", self.log())
        return int(started[-1]) if started else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def holder_pid(lease: Lease) -> int:
    return int(lease.holder.split(":")[1])


def test_two_controllers_only_the_leader_acts_and_the_standby_takes_over_after_kill_9(
        store: Store, db_url: str, tmp_path: Path, ray_head: RayHead) -> None:
    leases = Leases(store)
    spec = JobSpec.model_validate(tiny_spec(
        program="light",
        train={"steps": STEPS, "global_batch": 8, "micro_batch": 2, "precision": "fp32",
               "lr": 0.003},
        monitor={"probe": False}, max_retries=2, checkpoint={"every_steps": 20},
        # At least 0.2 s a step, so that the job outlasts the hand-over.
        faults=[{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.2}]))
    job_id = submit(store, spec).id
    daemons = [Daemon(f"c{i}", tmp_path, db_url, ray_head) for i in range(2)]

    def logs() -> str:
        return "\n".join(f"--- {d.log_path.name}\n{d.log()[-4000:]}" for d in daemons)

    def trained(n: int) -> Callable[[], bool]:
        return lambda: any(m.step >= n for m in store.list_metrics(job_id=job_id))

    try:
        wait_for("training", trained(3), 240, logs)
        first = leases.read(name=CONTROLLER)
        assert first is not None and first.expires_at > utcnow(), logs()
        [leader] = [d for d in daemons if d.daemon_pid() == holder_pid(first)]
        [standby] = [d for d in daemons if d is not leader]
        wait_for("the standby waiting", lambda: f"standby: the lease is held by {first.holder}"
                 in standby.log(), 60, logs)
        # The standby's daemon never held the lease: it made no controller, touched nothing.
        assert f"lease acquired by {socket.gethostname()}:{standby.daemon_pid()}:" not in \
            standby.log(), logs()

        os.kill(holder_pid(first), signal.SIGKILL)
        killed = time.monotonic()
        wait_for("taken over", lambda: (lease := leases.read(name=CONTROLLER)) is not None
                 and lease.holder != first.holder, 120, logs)
        took = leases.read(name=CONTROLLER)
        assert took is not None and took.epoch == first.epoch + 1
        assert took.acquired_at >= first.renewed_at  # not before the old one stopped renewing
        who = "the standby" if holder_pid(took) == standby.daemon_pid() else "the daemon its" \
            " supervisor started again"
        print(f"lease taken over by {who} ({took.holder}) {time.monotonic() - killed:.1f} s"
              f" after kill -9 of {first.holder} (lease {LEASE_S:g} s)")
        wait_for("finished", lambda: store.get_job(job_id=job_id).state.terminal, 300, logs)

        job = store.get_job(job_id=job_id)
        assert job.state == JobState.SUCCEEDED, (job.error, logs())
        assert job.attempts == 1, "a retry was used up"
        events = store.list_events(job_id=job_id, limit=1000)
        # One attempt, started once (by the first leader), re-attached once (by the second).
        assert [e.data["to"] for e in events if e.kind == "state"] == [
            "QUEUED", "PLACING", "RUNNING", "SUCCEEDED"]
        assert sum(e.kind == "placement" for e in events) == 1
        # Re-attached by the new leader; once more only if the lease changed hands again (a
        # leader too slow to renew on a loaded machine): never placed or started twice.
        assert sum(e.kind == "reattach" for e in events) >= 1
        for rank in (0, 1):  # every step of every rank, exactly once
            steps = [m.step for m in store.list_metrics(job_id=job_id, rank=rank)]
            assert steps == list(range(1, STEPS + 1)), (rank, steps)
    finally:
        for d in daemons:
            d.stop()
