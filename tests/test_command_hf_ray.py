"""A Hugging Face `Trainer` script (`examples/command/hf_trainer.py`) as a `command:` job, end to
end on a real local Ray through REST: 2 ranks on CPU (DDP over gloo) train to SUCCEEDED, its
steps and losses stored from the log dicts rank 0 prints (`progress: {preset: hf-trainer}`),
each rank's `TRIDENT_REPORT` lines (its process peak) stored with its steps, and the memory
and communication views say what the script did not report."""

from __future__ import annotations

import ast
import sys

import pytest

pytest.importorskip("ray")
pytest.importorskip("accelerate")

from service.contract.states import JobState  # noqa: E402
from tests.command_stack import EXAMPLES, logs, stack  # noqa: E402,F401
from tests.waiting import drive  # noqa: E402

pytestmark = pytest.mark.slow


def hf_spec(*args: str) -> dict[str, object]:
    return {
        "name": "hf-trainer", "model": {"preset": "gpt-tiny"}, "parallel": {"dp": 2},
        "train": {"steps": 4, "global_batch": 8, "micro_batch": 4, "precision": "fp32"},
        "resources": {"cpus_per_worker": 0.5},
        "command": [sys.executable, "hf_trainer.py", *args], "workdir": str(EXAMPLES),
        "progress": {"preset": "hf-trainer"}, "monitor": {"probe": False}}


def printed_losses(text: str) -> list[float]:
    """The losses of the Trainer's log dicts in a rank log (`{'loss': '5.378', ...}`)."""
    out = []
    for line in text.splitlines():
        at = line.find("{'loss': ")
        if at >= 0:
            out.append(float(ast.literal_eval(line[at:line.index("}", at) + 1])["loss"]))
    return out


def test_an_hf_trainer_script_trains_with_its_steps_and_reports(stack) -> None:  # noqa: F811
    client, store, controller = stack
    r = client.post("/api/v1/jobs", json=hf_spec("--steps", "4", "--report"))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    state = drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED}, 300)
    assert state == JobState.SUCCEEDED, store.get_job(job_id=job_id).error

    text = logs(client, job_id, 1)
    losses = printed_losses(text[0])
    assert len(losses) == 4 and all(4.0 < x < 7.0 for x in losses), text[0]
    steps = client.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    # From its own output (or, where rank 0's report line came first, the same loss unrounded).
    assert [float(f"{m['loss']:.4g}") for m in steps] == losses
    assert steps[0]["lr"] == pytest.approx(1e-3)

    # Rank 1 reads no progress lines: its steps are its report file's, with its memory.
    ones = client.get(f"/api/v1/jobs/{job_id}/metrics", params={"rank": 1}).json()["items"]
    assert [m["step"] for m in ones] == [1, 2, 3, 4]
    assert all(m["memory"]["process_peak_bytes"] > 50 << 20 for m in ones)
    assert [float(f"{m['loss']:.4g}") for m in ones] == losses  # DDP's mean, on both ranks

    comm = client.get(f"/api/v1/jobs/{job_id}/comm").json()["reported"]
    assert comm["source"] == "script" and comm["missing"] == "not reported"
    assert comm["comm_steps"] == 0 and comm["memory"]["params_bytes"] is None
    assert comm["memory"]["process_peak_bytes"] > 50 << 20
    page = client.get(f"/jobs/{job_id}").text
    assert "Memory reported by the script" in page and "<td>not reported</td>" in page
