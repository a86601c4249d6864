"""`trident submit`, `cancel`, `plan --compare`, completion, help and errors against a live
API server (uvicorn on a free port). A scripted controller (a thread writing to the store what
the real one would: states, an attempt, events, metrics) drives each job, so that every path
is exact and fast; tests/test_cli_ray.py runs the same commands on a real controller and Ray.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import click
import pytest
import typer

from cli.main import app
from client import rest as client
from service.contract.states import JobState
from service.store import Store
from tests.cli_stack import Live, runner
from tests.conftest import record_steps, user_token
from tests.servers import HTTP, free_port
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "examples/tiny.yaml")


FAILURE = ("attempt 1 failed: rank 1:\nTraceback (most recent call last):\n"
           "  File \"train.py\", line 9, in step\n    loss.backward()\n"
           "RuntimeError: rank 1 exploded\n")
"""A failed job's error as the controller stores it: a rank's traceback, over several lines."""


def run_job(store: Store, job_id: int, end: JobState, steps: int = 3,
            step_time_s: float = 0.25) -> None:
    """What the controller writes for a job that runs `steps` steps, then ends in `end`
    (CANCELLED: once someone asks for it)."""
    store.transition(job_id=job_id, to=JobState.PLACING, message="placing")
    store.start_attempt(job_id=job_id)
    store.add_event(job_id=job_id, kind="placement", message="rank 0 -> node-a, rank 1 -> node-a",
                    attempt=1)
    store.transition(job_id=job_id, to=JobState.RUNNING, message="running", attempt=1)
    record_steps(store, job_id=job_id, attempt=1, rows=[
        {"step": s, "rank": r, "loss": 4.0 / s, "step_time_s": step_time_s,
         "tokens_per_s": 1000.0} for s in range(1, steps + 1) for r in (0, 1)])
    if end == JobState.CANCELLED:
        wait_for("a cancel request", lambda: store.get_job(job_id=job_id).cancel_requested)
        store.transition(job_id=job_id, to=end, message="cancelled")
    else:
        store.transition(job_id=job_id, to=end, message=end.value.lower(),
                         error=FAILURE if end == JobState.FAILED else None)


def scripted(store: Store, end: JobState, **kw: object) -> threading.Thread:
    """A thread that runs the next submitted job (the first QUEUED one) to `end`."""
    def go() -> None:
        wait_for("a submitted job", lambda: bool(store.list_jobs(states=[JobState.QUEUED])[0]))
        run_job(store, store.list_jobs(states=[JobState.QUEUED])[0][0].id, end,
                **kw)  # type: ignore[arg-type]

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_submit_follows_the_job_and_exits_by_its_final_state(live: Live) -> None:
    """0 SUCCEEDED, 1 FAILED (its error on stderr), 3 CANCELLED; the steps and events are
    printed as they come, then the final state."""
    for end, code in ((JobState.SUCCEEDED, 0), (JobState.FAILED, 1), (JobState.CANCELLED, 3)):
        t = scripted(live.store, end)
        if end == JobState.CANCELLED:  # someone else cancels it while it runs
            threading.Thread(target=lambda: (
                wait_for("running", lambda: bool(live.store.list_jobs(
                    states=[JobState.RUNNING])[0])),
                live.store.request_cancel(job_id=live.store.list_jobs(
                    states=[JobState.RUNNING])[0][0].id)), daemon=True).start()
        r = live.cli("submit", TINY)
        t.join(10)
        assert r.exit_code == code, (end, r.output)
        lines = r.stdout.splitlines()
        job_id = int(lines[0].split()[1])
        assert lines[0] == f"job {job_id} submitted: tiny-zero2, tp1 pp1 dp2 zero2, 2 ranks"
        assert "  [placement] rank 0 -> node-a, rank 1 -> node-a" in lines
        assert [ln.split()[:2] for ln in lines if ln.startswith("  step")] == [
            ["step", "1/30"], ["step", "2/30"], ["step", "3/30"]]
        assert lines[-1] == f"job {job_id} {end.value}", lines
        # A failed job's error is one line: the traceback's exception, and where the rest is.
        assert r.stderr.splitlines() == ([
            f"error: job {job_id} FAILED: RuntimeError: rank 1 exploded (`trident describe"
            f" {job_id}` shows the error, `trident logs {job_id}` the ranks' output)"]
            if end == JobState.FAILED else []), r.stderr


def test_submit_detach_json_and_set(live: Live) -> None:
    r = live.cli("submit", TINY, "--detach", "--set", "train.steps=100",
                 "--set", "train.lr=3e-4", "--set", "parallel={tp: 1, dp: 2, zero: 1}")
    assert r.exit_code == 0, r.output
    job = live.store.get_job(job_id=int(r.stdout.strip()))
    assert job.spec.train.steps == 100 and job.spec.train.lr == 0.0003
    assert job.spec.layout.zero == 1
    r = live.cli("submit", TINY, "-d", "-o", "json", "--set", "name=scripted")
    assert r.exit_code == 0, r.output
    created = json.loads(r.stdout)
    assert created["name"] == "scripted" and created["state"] == "QUEUED"
    assert created["plan"]["layout"]["dp"] == 2
    # Following with -o json: stdout is the created job only, the follow goes to stderr.
    for j in live.store.list_jobs(states=[JobState.QUEUED])[0]:
        live.store.request_cancel(job_id=j.id)
    t = scripted(live.store, JobState.SUCCEEDED)
    r = live.cli("submit", TINY, "-o", "json")
    t.join(10)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["state"] == "QUEUED" and "SUCCEEDED" in r.stderr


def test_set_errors_are_one_line_naming_the_field(live: Live) -> None:
    cases = {
        "train.stepz=3": "--set train.stepz: unknown field train.stepz (train has: steps,",
        "trian.steps=3": "unknown field trian (the spec has: name, model, train,",
        "train.steps=abc": "train.steps: Input should be a valid integer"
                           " (from --set train.steps=abc)",
        "train.steps=0": "train.steps: Input should be greater than or equal to 1",
        "parallel.tp=3": "parallel.tp: tp(3) does not divide heads(4)",
        "train.steps": "--set 'train.steps': expected FIELD=VALUE",
        "env.FOO.BAR=1": "env.FOO is a plain value",
    }
    for item, message in cases.items():
        r = live.cli("submit", TINY, "-d", "--set", item)
        assert r.exit_code == 2, (item, r.output)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (item, r.stderr)
        assert "Traceback" not in r.output
    assert live.store.list_jobs()[1] == 0  # nothing was submitted


def test_submit_draws_a_progress_bar_on_a_terminal(live: Live) -> None:
    t = scripted(live.store, JobState.SUCCEEDED, steps=30)
    r = live.cli("submit", TINY, env={"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1",
                                      "COLUMNS": "120"})
    t.join(10)
    assert r.exit_code == 0, r.output
    assert "30/30\x1b[0m steps  loss 0.1333  0.250 s/step" in r.stdout and "━" in r.stdout
    assert "  step " not in r.stdout and f"job {live.store.list_jobs()[0][0].id} SUCCEEDED" \
        in r.stdout


def test_cancel_ids_all_and_the_confirmation(live: Live) -> None:
    ids = [int(live.cli("submit", TINY, "-d").stdout) for _ in range(4)]
    r = live.cli("cancel", str(ids[0]), str(ids[1]), input="n\n")
    assert r.exit_code == 1 and "nothing cancelled" in r.output
    assert f"cancel 2 job(s):\n  {ids[0]}\n  {ids[1]}\nproceed? [y/N]" in r.output
    assert all(live.store.get_job(job_id=i).state == JobState.QUEUED for i in ids)
    r = live.cli("cancel", str(ids[0]), input="y\n")
    assert r.exit_code == 0 and f"job {ids[0]}: CANCELLED (cancel requested)" in r.output
    # An ended job among others: the others are cancelled, the refusal named, exit 1.
    r = live.cli("cancel", str(ids[0]), str(ids[1]), "--yes")
    assert r.exit_code == 1, r.output
    assert f"job {ids[0]}: 409: job {ids[0]} is already CANCELLED" in r.stderr
    assert f"job {ids[1]}: CANCELLED" in r.stdout
    # --all, narrowed by state and owner: the prompt lists what it selects.
    live.store.transition(job_id=ids[2], to=JobState.PLACING, message="placing")
    r = live.cli("cancel", "--all", "--state", "queued,SUCCEEDED", "--owner", "admin",
                 input="y\n")
    assert r.exit_code == 0, r.output
    assert f"cancel 1 job(s):\n  {ids[3]:>5}  QUEUED     admin        tiny-zero2" in r.output
    assert live.store.get_job(job_id=ids[3]).state == JobState.CANCELLED
    assert live.store.get_job(job_id=ids[2]).state == JobState.PLACING
    r = live.cli("cancel", "--all", "--owner", "nobody", "--yes")
    assert r.exit_code == 0 and "nothing to cancel" in r.output
    r = live.cli("cancel", "--all", "--yes")
    assert r.exit_code == 0 and f"job {ids[2]}: PLACING (cancel requested)" in r.output
    assert live.store.get_job(job_id=ids[2]).cancel_requested
    for args, message in ((["--all", str(ids[0])], "not both"), ([], "give job ids"),
                          (["--state", "QUEUED", "1"], "select jobs for --all"),
                          (["--all", "--state", "DONE"], "unknown state 'DONE'")):
        r = live.cli("cancel", *args)
        assert r.exit_code == 2 and message in r.stderr, (args, r.output)


def test_plan_compare_scales_the_what_if_by_the_jobs_measurement(live: Live) -> None:
    job_id = int(live.cli("submit", TINY, "-d").stdout)
    predicted = live.store.get_job(job_id=job_id).plan.time.step_s
    run_job(live.store, job_id, JobState.SUCCEEDED, steps=8, step_time_s=2 * predicted)
    r = live.cli("plan", "--compare", str(job_id), "--set", "parallel.dp=1",
                 "--set", "cluster.gpus_per_node=1", "--set", "train.micro_batch=4", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["job"]["layout"] == "tp1 pp1 dp2 zero2 mb2" and out["job"]["steps_measured"] == 5
    assert out["expected"]["ratio"] == pytest.approx(2.0)
    assert out["what_if"]["layout"] == "tp1 pp1 dp1 zero2 mb4"
    assert out["expected"]["step_s"] == pytest.approx(2 * out["what_if"]["step_s"])
    r = live.cli("plan", TINY, "--set", "parallel.tp=2", "--set", "parallel.dp=1",
                 "--compare", str(job_id))
    assert r.exit_code == 0, r.output
    assert f"what-if against job {job_id} tiny-zero2: SUCCEEDED, 5 steady steps" in r.stdout
    assert "what-if (tp2 pp1 dp1 zero2 mb2)" in r.stdout
    assert "(predicted x 2.00, the job's measured/predicted)" in r.stdout
    r = live.cli("plan", "--compare", str(job_id), "--set", "parallel=auto")
    assert r.exit_code == 2 and "--compare needs an explicit layout" in r.stderr
    r = live.cli("plan", "--compare", "999")
    assert r.exit_code == 2 and "404" in r.stderr


def test_errors_are_one_line_never_a_traceback(live: Live, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    def one_line(r: click.testing.Result, code: int, *parts: str) -> None:
        assert r.exit_code == code, r.output
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output, r.output
        for p in parts:
            assert p in r.stderr, (p, r.stderr)

    # The retries and reconnects happen as they would, without their waits.
    monkeypatch.setattr(client, "BACKOFF_S", 0.001)
    monkeypatch.setattr(client, "RECONNECT_BACKOFF_S", 0.001)
    gone = f"http://127.0.0.1:{free_port()}"
    for args in (["status"], ["cancel", "1", "--yes"], ["logs", "1"], ["logs", "1", "-f"],
                 ["events", "1"], ["submit", TINY]):
        r = runner.invoke(app, [*args, "--server", gone])
        one_line(r, 2, f"cannot reach the Trident API at {gone}", "TRIDENT_SERVER")
    monkeypatch.setenv("TRIDENT_TOKEN", "trd_not-a-token")
    one_line(live.cli("events", "1"), 2, "401:", "set TRIDENT_TOKEN or run `trident login`")
    monkeypatch.setenv("TRIDENT_TOKEN", user_token(live.store, "vic", "viewer"))
    one_line(live.cli("submit", TINY), 2, "403: jobs:submit", "`trident whoami`")
    monkeypatch.setenv("TRIDENT_TOKEN", user_token(live.store))
    faults = '--set=faults=[{kind: fail, rank: 0, step: 1}]'
    one_line(live.cli("submit", TINY, faults), 2,
             "422: faults: fault injection is disabled on this server")
    one_line(live.cli("logs", "1", "--rank", "7"), 2, "404: job 1 not found")
    job_id = int(live.cli("submit", TINY, "-d").stdout)
    one_line(live.cli("logs", str(job_id), "--rank", "x"), 2, "expected rank numbers")


def test_every_command_has_help_with_an_example_and_completion_works() -> None:
    group = typer.main.get_command(app)
    names: list[list[str]] = []
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        if hasattr(cmd, "commands"):
            names += [[name, sub] for sub in cmd.commands]
        else:
            names.append([name])
    for path in names:
        r = runner.invoke(app, [*path, "--help"])
        assert r.exit_code == 0 and re.search(r"Example: .*trident ", r.output), (path,
                                                                                  r.output)
    r = runner.invoke(app, ["--help"])
    assert "--install-completion" in r.output
    complete = {"_TRIDENT_COMPLETE": "complete_bash", "COMP_CWORD": "3",
                "COMP_WORDS": "trident cancel --state "}
    r = runner.invoke(app, [], prog_name="trident", env=complete)
    assert r.output.split() == ["QUEUED", "PLACING", "RUNNING", "RESTARTING", "PREEMPTED"]


def test_plan_and_validate_take_set_without_a_server() -> None:
    r = runner.invoke(app, ["validate", TINY, "--set", "train.steps=7"])
    assert r.exit_code == 0 and '"steps": 7' in r.output
    r = runner.invoke(app, ["plan", TINY, "--set", "parallel.tp=2", "--set", "parallel.dp=1"])
    assert r.exit_code == 0 and "tp2 pp1 dp1 zero2" in r.output
    r = runner.invoke(app, ["plan"])
    assert r.exit_code == 2 and "give a SPEC" in r.output


def test_the_api_rejects_bad_log_queries(live: Live) -> None:
    job_id = int(live.cli("submit", TINY, "-d").stdout)
    h = {"Authorization": f"Bearer {user_token(live.store)}"}
    live.store.transition(job_id=job_id, to=JobState.PLACING, message="placing")
    live.store.start_attempt(job_id=job_id)
    for params, field in (({"tail": 0}, "tail"), ({"tail": 100_001}, "tail"),
                          ({"since_time": "yesterday"}, "since_time"),
                          ({"rank": [0] * 1025}, "rank"), ({"rank": 2}, "rank"),
                          ({"timestamps": "maybe"}, "timestamps")):
        r = HTTP.get(f"{live.url}/api/v1/jobs/{job_id}/logs", params=params, headers=h)
        assert r.status_code == 422, (params, r.text)
        assert r.json()["detail"][0]["loc"][:2] == ["query", field], r.text


def test_plan_marks_the_constants_the_cluster_measured(live: Live) -> None:
    """`trident plan --json`: every step-time constant `assumed` (with its source) on the
    built-in profile; with `--calibrated`, the profile the cluster's probe and calibration jobs
    measured, their constants `measured` with that source; `plan --compare` shows them too."""
    from dataclasses import replace

    from service.contract.hardware import StackCalibration, get_profile

    r = live.cli("plan", TINY, "--json", "--calibrated")
    assert r.exit_code == 0, r.output
    assert "no calibrated 'cpu' profile" in r.stderr
    assumed = json.loads(r.stdout)["constants"]
    assert {c["status"] for c in assumed.values()} == {"assumed"}
    assert all(c["source"] for c in assumed.values())
    probe = live.store.create_probe(scope="cluster", request={"profile": "cpu"}).id
    cal = StackCalibration(stack="trident", efficiency=0.61, jobs=(4, 5, 6, 7),
                           at="2026-12-07T12:00:00Z", error=0.08, precision="fp32")
    probed = replace(get_profile("cpu"), peak_flops_fp32=70e9, probed=f"trident probe {probe}"
                     " at 2026-12-07T11:59:00Z", layer_overhead_s=3e-3, calibration=cal)
    live.store.save_profile(name="cpu", profile=probed.to_json(), probe_id=probe)
    local = json.loads(live.cli("plan", TINY, "--json").stdout)["constants"]
    assert local["efficiency"]["status"] == "assumed"  # no --calibrated: the built-in profile
    r = live.cli("plan", TINY, "--json", "--calibrated")
    assert r.exit_code == 0, r.output
    measured = json.loads(r.stdout)["constants"]
    for name, value in (("efficiency", 0.61), ("layer_overhead_s", 3e-3)):
        assert measured[name] == {"value": value, "status": "measured", "source":
                                  "trident probe --calibrate: trident jobs 4, 5, 6, 7 at"
                                  " 2026-12-07T12:00:00Z"}
    assert measured["peak_flops"]["status"] == "measured"
    assert measured["peak_flops"]["source"] == f"trident probe {probe} at 2026-12-07T11:59:00Z"
    assert measured["gemm_curve"]["status"] == "assumed"
    text = live.cli("plan", TINY, "--calibrated").stdout
    assert "efficiency 0.61: measured (trident probe --calibrate: trident jobs 4, 5, 6, 7" in text
    assert (f"profile cpu: calibrated by probe {probe}; trident stack's efficiency 0.61 measured"
            " by jobs 4, 5, 6, 7 (fit error 8%)") in live.cli("cluster").stdout

    job_id = int(live.cli("submit", TINY, "-d").stdout)
    r = live.cli("plan", "--compare", str(job_id), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["what_if"]["constants"] == measured
    assert "efficiency 0.61: measured" in live.cli("plan", "--compare", str(job_id)).stdout
