"""Comparing runs: `service.views.side_by_side`, `GET /compare` through the real app, and
`trident compare` / `trident tensorboard` against a live API server; the jobs' steps are
written through the store as the controller writes them (no Ray). The page in a browser is
tests/test_browser.py's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.contract.reports import StepReport
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.store import Job, Store
from service.store.metrics import MetricsIngest
from service.submission.intake import Submitter, submit
from service.tracking.config import TrackingConfig
from service.views.side_by_side import differences, flatten
from tests.cli_stack import Live
from tests.conftest import tiny_spec
from tests.servers import HTTP


def test_differences_name_each_field_whose_values_differ() -> None:
    a = {"name": "a", "train": {"lr": 0.1, "steps": 5}, "env": {}, "faults": []}
    b = {"name": "b", "train": {"lr": 0.2, "steps": 5}, "env": {"X": "1"}, "faults": []}
    assert flatten(a) == {"name": "a", "train.lr": 0.1, "train.steps": 5, "faults": []}
    assert differences([a, b, a]) == [("name", ["a", "b", "a"]),
                                      ("train.lr", [0.1, 0.2, 0.1]),
                                      ("env.X", [None, "1", None])]
    assert differences([a, dict(a)]) == []


def trained(store: Store, *, name: str, lr: float, steps: int, custom: bool = False,
            tracking: TrackingConfig | None = None) -> Job:
    """A job that ran `steps` steps on 2 ranks (rank 0 and 1 reports stored)."""
    job = submit(store, JobSpec.model_validate(tiny_spec(
        name=name, train={"steps": steps, "global_batch": 8, "micro_batch": 2,
                          "precision": "fp32", "lr": lr})),
        by=Submitter(owner="admin", project="default", tracking=tracking))
    store.start_attempt(job_id=job.id)
    store.transition(job_id=job.id, to=JobState.PLACING, message="test")
    store.transition(job_id=job.id, to=JobState.RUNNING, message="test")
    MetricsIngest(store).record(job_id=job.id, attempt=1, world_size=2, rows=[
        StepReport(rank=r, step=s, loss=5.0 / s / lr, step_time_s=0.1 * (1 + lr),
                   tokens_per_s=1000.0 / (1 + lr),
                   custom={"accuracy": s / steps} if custom else None).row()
        for s in range(1, steps + 1) for r in (0, 1)])
    return store.transition(job_id=job.id, to=JobState.SUCCEEDED, message="test")


def test_compare_route_lines_up_curves_figures_and_differences(live: Live) -> None:
    a = trained(live.store, name="lr-small", lr=0.001, steps=8, custom=True)
    b = trained(live.store, name="lr-big", lr=0.01, steps=5)
    r = live.cli("compare", str(a.id), str(b.id), "-o", "json")
    assert r.exit_code == 0, r.output
    c = json.loads(r.output)
    assert [run["id"] for run in c["runs"]] == [a.id, b.id]
    assert [run["step"] for run in c["runs"]] == [8, 5]
    assert c["runs"][0]["loss"] == pytest.approx(5.0 / 8 / 0.001)
    assert c["runs"][0]["custom"] == {"accuracy": 1.0} and c["runs"][1]["custom"] == {}
    pm = c["runs"][1]["predicted_vs_measured"]
    assert pm["step_s"]["measured"] == pytest.approx(0.1 * 1.01)
    assert pm["step_s"]["predicted"] == pytest.approx(b.plan.time.step_s)
    assert c["runs"][0]["mfu_predicted"] == pytest.approx(b.plan.model_dump()["mfu"])
    # Each job's ETTR is its goodput ledger's.
    for run in c["runs"]:
        ledger = HTTP.get(f"{live.url}/api/v1/jobs/{run['id']}/goodput",
                          headers={"Authorization": f"Bearer {_token()}"}).json()
        assert run["ettr"] == ledger["ettr"] and 0 < run["ettr"] <= 1
    diff = {d["field"]: d["values"] for d in c["differences"]}
    assert diff == {"name": ["lr-small", "lr-big"], "train.steps": [8, 5],
                    "train.lr": [0.001, 0.01]}
    assert c["charted"][:4] == ["loss", "eval_loss", "step_time_s", "tokens_per_s"]
    assert "accuracy" in c["charted"] and "mfu" not in c["charted"]
    first = c["curves"][0]
    assert first["step"] == list(range(1, 9))
    assert first["metrics"]["loss"] == [pytest.approx(5.0 / s / 0.001) for s in range(1, 9)]
    assert first["metrics"]["accuracy"] == [s / 8 for s in range(1, 9)]
    assert first["metrics"]["eval_loss"] == [None] * 8  # none stored: a chart says so
    assert c["curves"][1]["metrics"]["accuracy"] == [None] * 5
    assert first["elapsed_s"] == sorted(first["elapsed_s"]) and first["elapsed_s"][0] >= 0
    text = live.cli("compare", str(a.id), str(b.id))
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    assert lines[0].split()[:3] == ["ID", "NAME", "STATE"]
    assert lines[1].split()[:5] == [str(a.id), "lr-small", "SUCCEEDED", "tp1", "pp1"]
    assert lines[0].split()[-1] == "ETTR"
    assert lines[1].split()[-1] == f"{100 * c['runs'][0]['ettr']:.1f}%"
    assert any(line.split() == ["train.lr", "0.001", "0.01"] for line in lines)
    assert any(line.split()[:1] == ["accuracy"] for line in lines)


def test_compare_refusals_are_one_line(live: Live) -> None:
    a = trained(live.store, name="a", lr=0.001, steps=2)
    for args, words in [((str(a.id),), "at least two"),
                        ((str(a.id), "999"), "job 999 not found"),
                        ((str(a.id), str(a.id)), "named twice"),
                        (tuple(str(i) for i in range(1, 10)), "at most 8")]:
        r = live.cli("compare", *args)
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
        assert r.output.startswith("error: ") and words in r.output, r.output


def test_tensorboard_prints_the_directories(live: Live, monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    cfg = TrackingConfig(tensorboard_root=live.settings.data_dir / "tensorboard")
    a = trained(live.store, name="a", lr=0.001, steps=2, tracking=cfg)
    b = trained(live.store, name="b", lr=0.001, steps=2)  # submitted without a tracker
    r = live.cli("tensorboard", str(a.id))
    assert r.exit_code == 0, r.output
    assert r.output.strip() == str(live.settings.data_dir / "tensorboard" / f"job-{a.id}")
    r = live.cli("tensorboard")
    assert r.output.strip() == str(live.settings.data_dir / "tensorboard")
    r = live.cli("tensorboard", str(b.id))
    assert r.exit_code == 2 and "no TensorBoard files" in r.output
    r = live.cli("tensorboard", str(a.id), "--serve")  # nothing exported yet: no directory
    assert r.exit_code == 2 and "not on this machine" in r.output, r.output


def test_the_jobs_page_offers_a_comparison_and_the_page_loads(live: Live) -> None:
    a = trained(live.store, name="a", lr=0.001, steps=2)
    b = trained(live.store, name="b", lr=0.01, steps=2)
    token = {"Authorization": f"Bearer {_token()}"}
    page = HTTP.get(f"{live.url}/", headers=token).text
    assert 'id="compare-selected"' in page
    r = HTTP.get(f"{live.url}/compare?jobs={a.id}&jobs={b.id}", headers=token)
    assert r.status_code == 200 and f'data-jobs="{a.id},{b.id}"' in r.text
    assert HTTP.get(f"{live.url}/compare?jobs={a.id}", headers=token).status_code == 422
    assert HTTP.get(f"{live.url}/compare?jobs={a.id}&jobs=999",
                    headers=token).status_code == 404


def _token() -> Any:
    import os

    return os.environ["TRIDENT_TOKEN"]


@pytest.mark.slow
def test_tensorboard_serve_starts_tensorboard_on_loopback_on_the_jobs_files(live: Live) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from service.tracking.exporter import Exporter
    from tests.mlflow_server import free_port

    cfg = TrackingConfig(tensorboard_root=live.settings.data_dir / "tensorboard")
    a = trained(live.store, name="a", lr=0.001, steps=4, tracking=cfg)
    Exporter(live.store, cfg.make_sink, allowed=cfg.allows, settle_s=0).cycle()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "tensorboard", str(a.id), "--serve",
                             "--port", str(port), "--server", live.url],
                            env=dict(os.environ), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                r = HTTP.get(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5)
                if r.status_code == 200 and "loss" in r.text:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "TensorBoard did not serve the job's scalars"
            time.sleep(0.5)
        assert {"loss", "step_time_s", "tokens_per_s"} <= set(next(iter(r.json().values())))
        import psutil

        listening = {c.laddr.ip for c in psutil.net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listening == {"127.0.0.1"}  # loopback only, unless --host says otherwise
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
