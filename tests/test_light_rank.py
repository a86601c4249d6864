"""The light rank program (`workers.rank.light`): steps on the clock, without torch.

Two ranks run it on threads of a fresh interpreter, each as the rank actor runs it (its
heartbeat, its fault injector's `begin` where a step starts and its stall before the step's
collective): the steps are reported as valid step reports, a slow fault's stall falls inside
the slow rank's step while its peer waits for it in the collective, a stop asked of one rank
ends both after the same step, a failing rank raises the injected fault, a line is printed
per step, and neither torch nor DeepSpeed nor the trainer was loaded, by the actor or by the
program. The gate: the API refuses `program: light` without `TRIDENT_LIGHT_RANKS` (a 422
naming the field), prod refuses the setting, and the launcher refuses to start such a job
where it is off.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from api.app import create_app
from service.contract.spec import JobSpec
from service.settings import Settings
from service.store import Store
from tests.conftest import authed_client, stored_plan, tiny_spec

RANKS = """
import io, json, socket, sys, threading, contextlib
from service.contract.reports import StepReport
from service.contract.spec import JobSpec
import workers.rank.actor
from workers.rank.faults import FaultInjector
from workers.runtime.heartbeat import Heartbeat
from workers.runtime.programs import RankContext, for_spec
from service.planner.stored import RankPlan

spec = JobSpec.model_validate(json.loads(sys.argv[1]))
stop_rank, stop_after = json.loads(sys.argv[2])
rows = [RankPlan.model_validate(row) for row in json.loads(sys.argv[3])]
program = for_spec(spec)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
reports = {0: [], 1: []}
errors = {}
hbs = {0: Heartbeat(0), 1: Heartbeat(1)}
stops = {0: threading.Event(), 1: threading.Event()}

def rank(r):
    hb = hbs[r]
    faults = FaultInjector(r, 1, spec.faults)
    ctx = RankContext(rank=r, world_size=2, local_rank=r, master_addr="127.0.0.1",
                      master_port=port, checkpoint_dir=None, plan=rows[r],
                      attempt=1, heartbeat=hb,
                      stall_before_collective=faults.stall_before_collective)

    def report(step):
        reports[r].append(StepReport.model_validate(step.model_dump()).model_dump())
        if r == stop_rank and step.step == stop_after:
            stops[r].set()

    try:
        program.run(spec, ctx, report, stops[r], faults.begin)
    except Exception as exc:
        errors[r] = str(exc)

out = io.StringIO()
with contextlib.redirect_stdout(out):
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t, wait in zip(threads, json.loads(sys.argv[4])):
        t.join(wait)
print(json.dumps({"program": program.name, "reports": reports, "errors": errors,
                  "beats": {r: hb.read().model_dump() for r, hb in hbs.items()},
                  "alive": [t.is_alive() for t in threads], "printed": out.getvalue().splitlines(),
                  "loaded": sorted(m for m in ("torch", "deepspeed", "numpy",
                                               "workers.trainer.train",
                                               "workers.monitor.comm_timer")
                                   if m in sys.modules)}))
"""


def run_ranks(spec: dict[str, object], stop: tuple[int, int] = (-1, 0),
              waits: tuple[float, float] = (60, 60)) -> dict[str, object]:
    """Two light ranks of `spec` on threads of a fresh interpreter, rank `stop[0]` asked to
    stop once it reported step `stop[1]`; each thread is waited for `waits[rank]` seconds."""
    plan = stored_plan(dp=2)  # here: the ranks are sent their rows, as the launcher sends them
    rows = json.dumps([plan.rank_plan(r).model_dump() for r in (0, 1)])
    run = subprocess.run([sys.executable, "-c", RANKS, json.dumps(spec), json.dumps(stop), rows,
                          json.dumps(waits)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_light_ranks_report_beat_print_and_stall_without_torch() -> None:
    out = run_ranks(tiny_spec(program="light", train={
        "steps": 4, "global_batch": 8, "micro_batch": 2, "precision": "fp32", "lr": 0.003},
        faults=[{"kind": "slow", "rank": 1, "step": 3, "seconds": 0.6}]))
    assert out["program"] == "light"
    assert out["loaded"] == [], "the light ranks and their actor load no torch"
    assert out["errors"] == {}
    reports = out["reports"]
    for r in ("0", "1"):
        steps = reports[r]
        assert [s["step"] for s in steps] == [1, 2, 3, 4]
        assert all(s["rank"] == int(r) and s["attempt"] == 1 and s["dp_rank"] == int(r)
                   for s in steps)
        assert all(s["tokens_per_s"] > 0 and s["memory"]["process_peak_bytes"] > 0
                   for s in steps)
        assert all(s["comm"]["dp"]["all_reduce"]["calls"] == 1 for s in steps)
        assert out["beats"][r]["step"] == 4 and out["beats"][r]["collective"] is None
    # The same made-up loss on both ranks, falling.
    assert [s["loss"] for s in reports["0"]] == [s["loss"] for s in reports["1"]]
    assert reports["0"][-1]["loss"] < reports["0"][0]["loss"]
    # Rank 1's stall is in its steps from 3 on, as compute: rank 0 waits for it in the
    # collective, so both steps take the stall, only rank 0's as collective time.
    slow, waiting = reports["1"][2], reports["0"][2]
    assert slow["step_time_s"] >= 0.6 and waiting["step_time_s"] >= 0.5
    assert slow["comm"]["dp"]["all_reduce"]["time_s"] < 0.3
    assert waiting["comm"]["dp"]["all_reduce"]["time_s"] >= 0.5
    assert reports["0"][0]["step_time_s"] < 0.6
    printed = out["printed"]
    assert sum("step 4/4" in line and "not measured" in line for line in printed) == 2


def test_a_stop_ends_every_light_rank_after_the_same_step() -> None:
    out = run_ranks(tiny_spec(program="light", train={
        "steps": 1000, "global_batch": 8, "micro_batch": 2, "precision": "fp32"}), stop=(1, 2))
    assert out["errors"] == {}
    assert [len(out["reports"][r]) for r in ("0", "1")] == [3, 3]


def test_a_light_rank_fails_on_cue() -> None:
    out = run_ranks(tiny_spec(program="light", faults=[{"kind": "fail", "rank": 0, "step": 2}],
                              train={"steps": 3, "global_batch": 8, "micro_batch": 2,
                                     "precision": "fp32"}), waits=(60, 1))
    # Rank 0 raises where step 2 starts; rank 1 waits in step 2's collective, as a trained
    # rank's peer would (until the group is stopped).
    assert out["errors"] == {"0": "injected fault: rank 0 fails at step 2"}
    assert [s["step"] for s in out["reports"]["0"]] == [1]
    assert out["alive"] == [False, True]
    waiting = out["beats"]["1"]
    assert waiting["step"] == 2 and waiting["collective"] == "all_reduce"
    assert waiting["dim"] == "dp" and waiting["group"] == [0, 1]


def test_light_ranks_need_the_server_setting(store: Store, tmp_path) -> None:
    spec = tiny_spec(program="light")
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as c:
        r = c.post("/api/v1/jobs", json=spec)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "program"]
        assert "TRIDENT_LIGHT_RANKS" in r.json()["detail"][0]["msg"]
    with authed_client(create_app(Settings(data_dir=tmp_path, light_ranks=True),
                                  store=store), store) as c:
        assert c.post("/api/v1/jobs", json=spec).status_code == 201
        r = c.post("/api/v1/jobs", json=tiny_spec(program="heavy"))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "program"]
    with pytest.raises(ValidationError, match="TRIDENT_LIGHT_RANKS must not be set in prod"):
        Settings(data_dir=tmp_path, env="prod", database_url="postgresql://db/x",
                 ray_address="ray://head:10001", light_ranks=True)


def test_the_launcher_starts_no_light_ranks_where_they_are_off() -> None:
    pytest.importorskip("ray")
    from workers.launch.launcher import RayLauncher

    spec = JobSpec.model_validate(tiny_spec(program="light"))
    with pytest.raises(ValueError, match=r"program: light.*TRIDENT_LIGHT_RANKS"):
        RayLauncher().start(job_id=1, attempt=1, spec=spec, plan=None,  # type: ignore[arg-type]
                            checkpoint_dir=None)
