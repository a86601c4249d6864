"""The CLI against the whole stack on a real local Ray: the API, the controller (stepping in
a thread, as the daemon does) and rank actors. `trident submit` exits 0 when the job
succeeds, 1 when a rank raises (`tests.entrypoints:explode`) and 3 when it is cancelled;
`trident logs -f` prints a running job's rank output until the cancel ends it. The ranks are
light (`program: light`, `workers.rank.light`): what is tested is the CLI and the control
plane, not training."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from service.settings import Settings  # noqa: E402
from tests.cli_stack import TINY, Live, finish, live_on, spawn  # noqa: E402
from tests.servers import served_stack  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(local_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Live]:
    with served_stack(Settings(data_dir=tmp_path, light_ranks=True), step_s=0.1,
                      start_timeout_s=120, cancel_grace_s=5) as served:
        yield live_on(monkeypatch, served.url, served.store, served.settings)


def test_submit_exit_codes_and_logs_follow_on_a_real_controller(stack: Live) -> None:
    r = stack.cli("submit", TINY, "--set", "train.steps=4", "--set", "program=light")
    assert r.exit_code == 0, r.output
    assert "step     4/4" in r.stdout and r.stdout.splitlines()[-1].endswith("SUCCEEDED")
    assert "[placement]" in r.stdout

    r = stack.cli("submit", TINY, "--set", "entrypoint=tests.entrypoints:explode",
                  "--set", "program=light")
    assert r.exit_code == 1, r.output
    assert r.stdout.splitlines()[-1].endswith("FAILED")
    # The rank's traceback as one line: its exception, and where the whole error is.
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert "RuntimeError: rank 1 exploded on purpose" in r.stderr and "trident describe" in r.stderr

    submit, submitted = spawn(stack, "submit", TINY, "--set",
                              "entrypoint=tests.entrypoints:chatty", "--set", "program=light")
    logs = None
    try:
        wait_for("the chatty job running", lambda: any(
            line.endswith(" RUNNING") for line in submitted), timeout_s=180)
        job_id = int(submitted[0].split()[1])
        logs = spawn(stack, "logs", str(job_id), "-f", "--rank", "1", "--tail", "2")
        wait_for("rank 1's output followed", lambda: sum(
            "chatty rank 1 step" in line for line in logs[1]) >= 4, timeout_s=60)
        r = stack.cli("cancel", str(job_id), "--yes")
        assert r.exit_code == 0, r.output
        assert finish(submit, submitted) == 3, submitted
        assert finish(*logs) == 0, logs[1]
    finally:
        for proc in (submit, *(logs[:1] if logs else ())):
            if proc.poll() is None:
                proc.kill()
    assert submitted[-1] == f"job {job_id} CANCELLED", submitted
    followed = logs[1]
    assert followed and all(line.startswith("[rank 1] ") for line in followed), followed
    steps = [int(line.rsplit(" ", 1)[1]) for line in followed if "chatty rank 1 step" in line]
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # every line, once, in order

