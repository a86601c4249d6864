"""`trident status`, `top` and `describe` on a real job: the demo spec on a local Ray, the
controller stepped in this process, the API served by uvicorn over the same store."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from typer.testing import CliRunner  # noqa: E402

from cli.main import app  # noqa: E402
from service.contract.spec import JobSpec  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.control.controller import Controller  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.store import Store  # noqa: E402
from service.submission.intake import submit  # noqa: E402
from tests.conftest import tiny_spec, user_token  # noqa: E402
from tests.servers import served_stack  # noqa: E402
from tests.waiting import drive, drive_until  # noqa: E402

pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture
def served(local_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[tuple[str, Store, Controller]]:
    monkeypatch.setenv("TRIDENT_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TRIDENT_CONFIG_DIR", str(tmp_path / "config"))
    with served_stack(Settings(data_dir=tmp_path, light_ranks=True), step_s=None,
                      start_timeout_s=120, cancel_grace_s=5) as stack:
        monkeypatch.setenv("TRIDENT_TOKEN", user_token(stack.store))
        yield stack.url, stack.store, stack.controller


def cli(url: str, *args: str) -> str:
    r = runner.invoke(app, [*args, "--server", url])
    assert r.exit_code == 0, r.output
    return r.output


def test_views_of_a_real_job(served: tuple[str, Store, Controller]) -> None:
    url, store, controller = served
    spec = tiny_spec(program="light", train={"steps": 30, "global_batch": 8,
                                             "micro_batch": 2, "precision": "fp32",
                                             "lr": 0.003},
                     monitor={"probe": True, "probe_max_bytes": 64 << 10})
    job_id = submit(store, JobSpec.model_validate(spec)).id
    def stepped() -> bool:
        m = store.latest_metric(job_id=job_id)
        assert not store.get_job(job_id=job_id).state.terminal, store.get_job(job_id=job_id)
        return m is not None and m.step >= 2

    drive_until(controller, stepped, 240, f"job {job_id}'s second step")
    row = json.loads(cli(url, "status", str(job_id), "-o", "json"))
    assert row["state"] == "RUNNING" and row["step"] >= 2 and row["step_s_measured"] > 0
    frame = cli(url, "top", str(job_id), "-n", "1").splitlines()
    assert frame[0].startswith(f"job {job_id} tiny  RUNNING  tp1 pp1 dp2 zero2  attempt 1")
    hostname = socket.gethostname()
    ranks = [ln.split() for ln in frame[2:]]
    assert [r[0] for r in ranks] == ["0", "1"] and all(r[4] == hostname for r in ranks)
    assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 300) == JobState.SUCCEEDED
    out = cli(url, "describe", str(job_id))
    assert "State:        SUCCEEDED" in out and "step 30/30" in out, out
    assert "#1  succeeded" in out and f"node {hostname} (" in out and "ranks 0-1" in out
    assert "rendezvous" in out  # the placement event
    d = json.loads(cli(url, "describe", str(job_id), "-o", "json"))
    assert d["predicted_vs_measured"]["step_s"]["measured"] > 0
    assert d["attempts"][0]["nodes"][0]["ranks"] == [0, 1]
