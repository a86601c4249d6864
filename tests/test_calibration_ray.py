"""`trident probe --calibrate` on this CPU, end to end on a real local Ray: the probe, the
calibration jobs (Trident's trainer, one rank each), the fit of their measured step times, and
the plan of a job on the cluster marking the trident stack's constants `measured`."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from service.contract.hardware import get_profile  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.planner.calibrate import calibration_specs  # noqa: E402
from tests.waiting import drive, drive_until  # noqa: E402

pytestmark = pytest.mark.slow


def _plan_constants(client) -> dict:
    spec = calibration_specs(get_profile("cpu"))[2]
    r = client.post("/api/v1/plan", json=spec)
    assert r.status_code == 200, r.text
    constants: dict = r.json()["constants"]
    return constants


def test_calibration_jobs_fit_the_trident_constants_that_plans_mark_measured(stack) -> None:
    client, store, controller = stack
    jobs = {"profile": "cpu", "jobs": [1, 2, 3]}
    r = client.post("/api/v1/calibrations", json=jobs)
    assert r.status_code == 404 and "trident probe --profile cpu" in r.json()["detail"]
    assert {c["status"] for c in _plan_constants(client).values()} == {"assumed"}

    probe = client.post("/api/v1/probes", json={"ranks_per_node": 1, "max_bytes": 1024}).json()
    drive_until(controller, lambda: store.get_probe(probe_id=probe["id"]).status
                not in ("pending", "running"), 120, f"probe {probe['id']} finished")
    assert store.get_probe(probe_id=probe["id"]).status == "done"
    probed = _plan_constants(client)
    assert probed["peak_flops"]["status"] == "measured"
    assert probed["peak_flops"]["source"].startswith(f"trident probe {probe['id']} at ")
    assert probed["efficiency"]["status"] == "assumed"

    ids = []
    for spec in calibration_specs(get_profile("cpu")):  # one after another, as the CLI runs them
        job_id = client.post("/api/v1/jobs", json=spec).json()["id"]
        assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                     240) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
        ids.append(job_id)
    bad = client.post("/api/v1/calibrations", json={"profile": "cpu", "jobs": ids[:2] + [999]})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "jobs"]
    assert "job 999 not found" in bad.json()["detail"][0]["msg"]

    r = client.post("/api/v1/calibrations", json={"profile": "cpu", "jobs": ids})
    assert r.status_code == 200, r.text
    out = r.json()
    cal = out["calibration"]
    print("calibrated cpu:", {k: out[k] for k in ("layer_overhead_s", "step_overhead_s")}, cal)
    assert cal["stack"] == "trident" and cal["jobs"] == ids and out["probe_id"] == probe["id"]
    assert 0 < cal["efficiency"] < 2 and out["layer_overhead_s"] >= 0
    assert cal["error"] < 0.5  # three real runs on two shared cores; printed above
    assert client.get("/api/v1/cluster").json()["profiles"]["cpu"]["calibration"] == cal

    measured = _plan_constants(client)
    source = f"trident probe --calibrate: trident jobs {', '.join(map(str, ids))} at {cal['at']}"
    for name in ("efficiency", "layer_overhead_s", "step_overhead_s"):
        assert measured[name]["status"] == "measured" and measured[name]["source"] == source
    assert measured["efficiency"]["value"] == pytest.approx(cal["efficiency"])
    assert measured["peak_flops"]["status"] == "measured"
