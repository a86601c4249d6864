"""`trident profile` on a real local Ray: the CLI asks, the controller has both torch ranks of a
running 2-rank job profile their next steps, the traces are stored with the job and downloaded,
read back as Chrome trace JSON with whole profiled steps; the job's losses are those of the same
job run beside it without profiling."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

pytest.importorskip("ray")

from typer.testing import CliRunner  # noqa: E402

import cli.profile  # noqa: E402
from cli.main import app as cli_app  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from tests.conftest import tiny_spec  # noqa: E402
from tests.inprocess import client_of  # noqa: E402
from tests.waiting import drive, drive_until, passes_beside  # noqa: E402

pytestmark = pytest.mark.slow


def test_profiled_steps_are_chrome_traces_of_whole_steps_and_change_no_loss(
        stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    client, store, controller = stack
    spec = tiny_spec(
        train={"steps": 30, "global_batch": 8, "micro_batch": 2, "precision": "fp32",
               "lr": 0.003},
        monitor={"probe": False},
        # Every step takes at least 0.2 s, so that the job outlasts the request.
        faults=[{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.2}])
    profiled, plain = (client.post("/api/v1/jobs", json=spec).json()["id"] for _ in range(2))

    def training() -> bool:
        job = store.get_job(job_id=profiled)
        assert not job.state.terminal, f"job ended: {job.error}"
        return any(m.step >= 2 for m in store.list_metrics(job_id=profiled, rank=1))

    drive_until(controller, training, 300, "step 2 of rank 1")
    # The CLI waits for the traces while the controller's passes go on beside it.
    monkeypatch.setattr(cli.profile, "connect", lambda s: client_of(client))
    out = tmp_path / "traces"
    with passes_beside(controller):
        r = CliRunner().invoke(cli_app, ["profile", str(profiled), "--steps", "2",
                                         "--ranks", "0,1", "--out", str(out)])
        listed = CliRunner().invoke(cli_app, ["profile", str(profiled), "--list"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["rank-0.pt.trace.json.gz",
                                                     "rank-1.pt.trace.json.gz"], r.output
    assert listed.exit_code == 0 and "rank-1.pt.trace.json.gz" in listed.output, listed.output
    req = client.get(f"/api/v1/jobs/{profiled}/profile").json()["items"][0]
    assert req["status"] == "done" and req["attempt"] == 1, req
    first, last = req["profiled_steps"]["0"]
    assert last - first == 1 and req["profiled_steps"]["1"] == [first, last], req
    for rank in (0, 1):
        with gzip.open(out / f"rank-{rank}.pt.trace.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        steps = {e["name"]: e for e in events if str(e.get("name")).startswith("ProfilerStep#")}
        assert set(steps) == {f"ProfilerStep#{first}", f"ProfilerStep#{last}"}, rank
        for e in steps.values():  # whole steps: a complete range, with the step's ops in it
            assert e["ph"] == "X" and e["dur"] > 0
            inside = [o for o in events if o.get("cat") == "cpu_op"
                      and e["ts"] <= o["ts"] <= e["ts"] + e["dur"]]
            assert any("addmm" in o["name"] or "mm" in o["name"] for o in inside), rank
            assert any("Input Dims" in o.get("args", {}) for o in inside)  # record_shapes
    # Profiling changed no number: the same losses as the same job unprofiled, every step.
    for job_id in (profiled, plain):
        assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                     600) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
    losses = [[(m.step, m.loss) for m in store.list_metrics(job_id=j, rank=0)]
              for j in (profiled, plain)]
    assert len(losses[0]) == 30 and losses[0] == losses[1]
