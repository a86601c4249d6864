"""`trident probe --calibrate` on this CPU, end to end on a real local Ray: the command as a
user runs it (the probe, the calibration jobs of Trident's trainer one rank each, the fit of
their measured step times), and the plan of a job on the cluster marking the trident stack's
constants `measured`."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from typer.testing import CliRunner  # noqa: E402

import cli.main  # noqa: E402
from service.contract.hardware import get_profile  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.planner.calibrate import calibration_specs  # noqa: E402
from tests.inprocess import client_of  # noqa: E402
from tests.waiting import passes_beside  # noqa: E402

pytestmark = pytest.mark.slow


def _plan_constants(client) -> dict:
    spec = calibration_specs(get_profile("cpu"))[2]
    r = client.post("/api/v1/plan", json=spec)
    assert r.status_code == 200, r.text
    constants: dict = r.json()["constants"]
    return constants


def test_probe_calibrate_fits_the_trident_constants_that_plans_mark_measured(
        stack, monkeypatch: pytest.MonkeyPatch) -> None:
    client, store, controller = stack
    r = client.post("/api/v1/calibrations", json={"profile": "cpu", "jobs": [1, 2, 3]})
    assert r.status_code == 404 and "trident probe --profile cpu" in r.json()["detail"]
    assert {c["status"] for c in _plan_constants(client).values()} == {"assumed"}

    # `trident probe --calibrate` as a user runs it, the controller's passes beside it.
    monkeypatch.setattr(cli.main, "connect", lambda s: client_of(client))
    with passes_beside(controller):
        r = CliRunner().invoke(cli.main.app, ["probe", "--ranks-per-node", "1", "--max-bytes",
                                              "1024", "--calibrate", "--timeout", "400"])
    print(r.output)
    assert r.exit_code == 0, r.output
    probe = client.get("/api/v1/probes").json()["items"][0]
    ids = sorted(j.id for j in store.list_jobs()[0])
    assert len(ids) == 4 and f"(jobs {', '.join(map(str, ids))})" in r.output
    assert all(store.get_job(job_id=j).state == JobState.SUCCEEDED for j in ids)
    bad = client.post("/api/v1/calibrations", json={"profile": "cpu", "jobs": ids[:2] + [999]})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "jobs"]
    assert "job 999 not found" in bad.json()["detail"][0]["msg"]

    out = client.get("/api/v1/cluster").json()["profiles"]["cpu"]
    cal = out["calibration"]
    print("calibrated cpu:", {k: out[k] for k in ("layer_overhead_s", "step_overhead_s")}, cal)
    assert cal["stack"] == "trident" and cal["jobs"] == ids
    assert out["probe_id"] == probe["id"]
    assert 0 < cal["efficiency"] < 5 and out["layer_overhead_s"] >= 0
    assert cal["error"] < 0.5  # four real runs on two shared cores; printed above

    measured = _plan_constants(client)
    source = (f"trident probe --calibrate: trident jobs {', '.join(map(str, ids))}"
              f" at {cal['at']}")
    for name in ("efficiency", "layer_overhead_s", "step_overhead_s"):
        assert measured[name]["status"] == "measured" and measured[name]["source"] == source
    assert measured["efficiency"]["value"] == pytest.approx(cal["efficiency"])
    assert measured["peak_flops"]["status"] == "measured"
    assert measured["peak_flops"]["source"].startswith(f"trident probe {probe['id']} at ")
