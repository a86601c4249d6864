"""`trident status`, `describe` and `top` against a real API server (uvicorn on a free port)
whose jobs, attempts, step reports and events are written through the store, as the
controller writes them: no Ray. `--watch` and `top` run for a counted number of refreshes,
piped (frames one after another) and on a pseudo-terminal (redrawn in place)."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from api.app import create_app
from cli.describe import ranges
from cli.format import columns, span
from cli.main import app
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.settings import Settings
from service.store import Store
from service.store.heartbeats import HeartbeatLog
from service.store.views import AttemptStatus
from service.submission.intake import Submitter, submit
from tests.conftest import record_steps, tiny_spec
from tests.servers import HTTP, serving

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()

STACK = "Traceback (most recent call last):\n  File \"train.py\", line 9, in step\n" \
        "    dist.all_reduce(grad)\n"
ERROR = "rank 1 failed:\nTraceback (most recent call last):\n  File \"x.py\", line 3\n" \
        "RuntimeError: CUDA out of memory"


def report(step: int, rank: int, *, step_time_s: float = 0.5, dp_s: float = 0.1,
           peak: int = 1 << 20) -> dict[str, Any]:
    """A step report as the ranks send it: comm time per op, memory."""
    return {"step": step, "rank": rank, "loss": 5.0 - step / 10, "step_time_s": step_time_s,
            "tokens_per_s": 100.0, "lr": 2e-4 / step, "grad_norm": 1.25 * step,
            "data": {"comm": {"dp": {"all_reduce": {"time_s": dp_s, "bytes": 1000,
                                                    "calls": 1}}},
                     "memory": {"process_peak_bytes": peak}}}


def placement(hosts: list[str]) -> dict[str, Any]:
    return {"ranks": [{"rank": r, "node_id": f"node-{h}-0123456789", "hostname": h,
                       "ip": "127.0.0.1", "pid": 100 + r, "nice": 0, "gpu_ids": []}
                      for r, h in enumerate(hosts)], "master": "127.0.0.1:1"}


def seed(store: Store) -> dict[str, int]:
    """Four jobs: queued, running (a straggler, restarted once), failed on a hang, cancelled."""
    def new(name: str, owner: str) -> int:
        spec = JobSpec.model_validate(tiny_spec(name=name))
        return submit(store, spec, by=Submitter(owner=owner, project="default")).id

    ids = {"failed": new("hang-job", "bob"), "running": new("train-big", "alice"),
           "cancelled": new("old-run", "alice"), "queued": new("waits", "bob")}
    run = ids["running"]
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=run, to=to, message=to.value)
    store.start_attempt(job_id=run)
    store.set_placement(job_id=run, number=1, placement=placement(["h1", "h1"]))
    store.end_attempt(job_id=run, number=1, status=AttemptStatus.FAILED, error=ERROR)
    store.start_attempt(job_id=run)
    store.set_placement(job_id=run, number=2, placement=placement(["h1", "h2"]))
    record_steps(store, job_id=run, attempt=2, rows=[
        report(s, r, dp_s=0.1 if r == 0 else 0.05, step_time_s=0.5 if r == 0 else 0.9)
        for s in (1, 2, 3) for r in (0, 1)])
    store.add_event(job_id=run, attempt=2, kind="straggler", message="rank 1 is slow",
                    data={"rank": 1})
    # Rank 0 was last heard from an hour ago (a hang would look so); rank 1 never.
    HeartbeatLog(store).record(job_id=run, attempt=2, seen={0: time.time() - 3600})
    bad = ids["failed"]
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=bad, to=to, message=to.value)
    store.start_attempt(job_id=bad)
    store.set_placement(job_id=bad, number=1, placement=placement(["h3", "h3"]))
    store.add_event(job_id=bad, attempt=1, kind="hang", message="no progress for 60 s",
                    data={"never_arrived": [1]})
    for r in (0, 1):
        store.add_event(job_id=bad, attempt=1, kind="stacks", message=f"rank {r} stacks",
                        data={"rank": r, "stacks": STACK})
    store.end_attempt(job_id=bad, number=1, status=AttemptStatus.FAILED, error=ERROR)
    store.transition(job_id=bad, to=JobState.FAILED, message="attempt 1 failed", error=ERROR)
    store.transition(job_id=ids["cancelled"], to=JobState.CANCELLED, message="cancelled")
    return ids


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict[str, int]]]:
    """An API server (no controller) over a store with `seed`'s jobs; the CLI finds the
    bootstrap admin's token through TRIDENT_DATA_DIR."""
    monkeypatch.setenv("TRIDENT_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TRIDENT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("TRIDENT_TOKEN", raising=False)
    settings = Settings(data_dir=tmp_path)
    with serving(create_app(settings)) as url:
        store = Store(settings.db_url)
        try:
            ids = seed(store)
        finally:
            store.close()
        yield url, ids


def cli(url: str, *args: str, code: int = 0) -> str:
    r = runner.invoke(app, [*args, "--server", url])
    assert r.exit_code == code, r.output
    return r.output


def test_helpers() -> None:
    assert ranges([3, 0, 1, 2, 6, 8, 9]) == "0-3,6,8-9" and ranges([]) == ""
    assert [span(s) for s in (5, 192, 7500, 90000, None)] == ["5s", "3m12s", "2h05m", "1d01h",
                                                               "-"]
    assert columns(["A", "LONG"], [["xx", "y"], ["z", ""]]).splitlines() == [
        "A   LONG", "xx  y", "z"]


def test_status_columns_filters_sorts_and_formats(stack: tuple[str, dict[str, int]]) -> None:
    url, ids = stack
    lines = cli(url, "status").splitlines()
    assert lines[0].split() == ["ID", "NAME", "OWNER", "LAYOUT", "RANKS", "SUBMITTED",
                                "DURATION", "STEP", "LOSS", "S/STEP", "RESTARTS", "STATE",
                                "REASON"]
    assert [int(ln.split()[0]) for ln in lines[1:]] == sorted(ids.values(), reverse=True)
    row = {int(ln.split()[0]): ln for ln in lines[1:]}
    running = row[ids["running"]]
    assert " 3/6 " in running and " 4.7 " in running and "/0.5 " in running
    assert " 1 " in running and "RUNNING" in running  # one restart
    assert "first in line; waits until the cluster has 2 rank(s)" in row[ids["queued"]]
    assert row[ids["failed"]].endswith("RuntimeError: CUDA out of memory")
    # Filters: state (comma-separated or repeated, any case), owner, name.
    out = cli(url, "status", "--state", "running,queued", "--no-headers")
    assert sorted(int(ln.split()[0]) for ln in out.splitlines()) == sorted(
        [ids["running"], ids["queued"]])
    out = cli(url, "status", "--state", "FAILED", "--state", "CANCELLED", "--owner", "alice",
              "--no-headers")
    assert [int(ln.split()[0]) for ln in out.splitlines()] == [ids["cancelled"]]
    out = cli(url, "status", "--name", "train", "--no-headers")
    assert [int(ln.split()[0]) for ln in out.splitlines()] == [ids["running"]]
    assert cli(url, "status", "--project", "nope", "--no-headers").strip() == ""
    r = runner.invoke(app, ["status", "--limit", "2", "--no-headers", "--server", url])
    assert r.exit_code == 0 and len(r.stdout.splitlines()) == 2
    assert "(2 of 4 jobs; --limit shows more)" in r.stderr
    # Sort: by the server (name) and by the page (step: the job without one last).
    out = cli(url, "status", "--sort-by", "name", "--no-headers")
    assert [ln.split()[1] for ln in out.splitlines()] == ["hang-job", "old-run", "train-big",
                                                          "waits"]
    out = cli(url, "status", "--sort-by=-name", "--no-headers")
    assert out.splitlines()[0].split()[1] == "waits"
    out = cli(url, "status", "--sort-by=-step", "--no-headers")
    assert int(out.splitlines()[0].split()[0]) == ids["running"]
    # JSON and YAML: the documented row.
    doc = json.loads(cli(url, "status", "-o", "json"))
    assert doc["total"] == 4 and len(doc["items"]) == 4
    r = next(i for i in doc["items"] if i["id"] == ids["running"])
    assert list(r) == ["id", "name", "owner", "project", "state", "layout", "ranks",
                       "priority", "submitted", "started", "finished", "duration_s", "step",
                       "total_steps", "loss", "loss_nonfinite", "lr", "grad_norm", "eval_loss",
                       "tokens", "epoch", "step_s_predicted", "step_s_measured", "reported_at",
                       "attempts", "restarts", "queue_position", "reason", "error"]
    assert (r["step"], r["total_steps"], r["restarts"], r["attempts"]) == (3, 6, 1, 2)
    assert r["loss"] == pytest.approx(4.7) and r["step_s_measured"] == 0.5
    assert r["layout"] == "tp1 pp1 dp2 zero2" and r["owner"] == "alice"
    one = yaml.safe_load(cli(url, "status", str(ids["queued"]), "-o", "yaml"))
    assert one["id"] == ids["queued"] and one["queue_position"] == 1 and one["step"] is None
    assert r["lr"] == pytest.approx(2e-4 / 3) and r["grad_norm"] == pytest.approx(3.75)
    wide = cli(url, "status", "-o", "wide").splitlines()
    assert "PROJECT" in wide[0] and "PRIORITY" in wide[0] and "REPORTED" in wide[0]
    assert "LR" in wide[0].split() and "GRAD_NORM" in wide[0].split()
    assert "default" in wide[1]
    running = next(ln for ln in wide if ln.split()[0] == str(ids["running"]))
    assert " 6.67e-05 " in running and " 3.75 " in running


def test_status_refusals_are_one_line(stack: tuple[str, dict[str, int]]) -> None:
    url, _ = stack
    out = cli(url, "status", "--state", "DONE", code=2)
    assert out.strip().startswith("error: --state: unknown state 'DONE'")
    out = cli(url, "status", "--sort-by", "colour", code=2)
    assert "--sort-by: unknown key 'colour'" in out and "Traceback" not in out
    out = cli(url, "status", "9999", code=2)
    assert out.strip() == "error: 404: job 9999 not found"
    out = cli(url, "describe", "9999", code=2)
    assert "404" in out and len(out.strip().splitlines()) == 1
    out = cli(url, "top", "9999", "-n", "1", code=2)
    assert "404" in out and len(out.strip().splitlines()) == 1


def test_status_watch_prints_each_refresh(stack: tuple[str, dict[str, int]]) -> None:
    url, ids = stack
    out = cli(url, "status", "--watch", "--watch-count", "3", "--interval", "0.1")
    assert out.count("ID  NAME") == 3
    assert [ln.split()[:2] for ln in out.splitlines()].count([str(ids["running"]),
                                                              "train-big"]) == 3
    out = cli(url, "status", str(ids["running"]), "-w", "--watch-count", "2", "--interval",
              "0.1", "-o", "json")
    docs = [json.loads(line) for line in out.splitlines()]  # JSON Lines
    assert [d["id"] for d in docs] == [ids["running"]] * 2
    out = cli(url, "status", "-w", "--watch-count", "2", "--interval", "0.1", "-o", "yaml")
    docs = list(yaml.safe_load_all(out))
    assert len(docs) == 2 and all(d["total"] == 4 for d in docs)


STACKS_ON_USR1 = ("import faulthandler, runpy, signal, sys;"
                  " faulthandler.register(signal.SIGUSR1, all_threads=True);"
                  " sys.argv[0] = 'trident'; runpy.run_module('cli.main', run_name='__main__')")
"""`python -m cli.main`, which also writes every thread's stack to stderr at SIGUSR1."""


def as_a_shell_starts_it() -> None:
    """In the child, before `exec`: Ctrl-C at its default and not blocked, whatever the test
    process inherited or set up (dispositions set to ignore and blocked signals outlive
    `exec`; a pytest worker that ran other tests first may have either)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def signal_state(pid: int | str) -> str:
    """The blocked, ignored and caught signals of process `pid` (or "self"), as masks."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return " ".join(ln.replace("\t", "") for ln in status if ln[:6] in ("SigBlk", "SigIgn",
                                                                       "SigCgt"))


def tty_run(url: str, *args: str, interrupt_at: str | None = None,
            timeout: float = 60) -> str:
    """`trident ARGS` on a pseudo-terminal (what a person sees): its raw output. With
    `interrupt_at`, Ctrl-C (SIGINT) once the output shows that text; it must exit 0. A
    command still running 10 s after it is pressed again, as a person would (once: one that
    outlives both fails), after a warning in the test report shows its stacks."""
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm", "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-c", STACKS_ON_USR1, *args, "--server", url],
                            stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT,
                            preexec_fn=as_a_shell_starts_it)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    interrupted_at: float | None = None
    try:
        while True:
            assert time.monotonic() < deadline, f"no exit in {timeout} s: {b''.join(chunks)!r}"
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
            if interrupt_at is not None and interrupt_at.encode() in b"".join(chunks):
                proc.send_signal(signal.SIGINT)
                interrupt_at, interrupted_at = None, time.monotonic()
            elif interrupted_at is not None and time.monotonic() - interrupted_at > 10:
                state = f"command: {signal_state(proc.pid)}; test: {signal_state('self')}"
                proc.send_signal(signal.SIGUSR1)
                time.sleep(1)
                stacks = os.read(master, 1 << 20).decode(errors="replace")
                warnings.warn(f"a Ctrl-C of `trident {' '.join(args)}` was lost ({state});"
                              f" its stacks 10 s later:\n{stacks}", stacklevel=2)
                proc.send_signal(signal.SIGINT)
                interrupted_at = None
        assert proc.wait(timeout=10) == 0, b"".join(chunks)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return b"".join(chunks).decode()


def test_watch_and_top_redraw_in_place_on_a_terminal(stack: tuple[str, dict[str, int]]) -> None:
    url, ids = stack
    out = tty_run(url, "status", "--watch", "--watch-count", "2", "--interval", "0.1")
    # rich Live moves the cursor up over the last frame and erases it (ESC[1A, ESC[2K)
    # before each redraw (and draws the last frame once more as it stops).
    assert out.count("train-big") >= 2 and "\x1b[1A" in out and "\x1b[2K" in out
    out = tty_run(url, "top", str(ids["running"]), "-n", "2", "--interval", "0.1")
    assert out.count("RANK  TP") >= 2 and "\x1b[1A" in out
    # Unbounded, until Ctrl-C: it ends quietly, exit status 0, no traceback.
    out = tty_run(url, "top", "--interval", "0.2", interrupt_at="train-big")
    assert "train-big" in out and "Traceback" not in out and "KeyboardInterrupt" not in out


def test_describe_shows_everything_about_a_job(stack: tuple[str, dict[str, int]]) -> None:
    url, ids = stack
    out = cli(url, "describe", str(ids["running"]))
    for text in ("Name:         train-big", "State:        RUNNING", "Attempts:     2 (1",
                 "step 3/6, loss 4.7", "lr 6.67e-05 at step 3, gradient norm 3.75 before"
                 " clipping (clip 1.0)", "Plan against measurement", "s/step", "tokens/s",
                 "dp s", "Spec:", "  name: train-big", "#1  failed", "#2  running",
                 "node h1 (node-h1-0123): ranks 0-1", "node h2 (node-h2-0123): ranks 1",
                 "error: RuntimeError: CUDA out of memory", "straggler", "rank 1 is slow"):
        assert text in out, (text, out)
    out = cli(url, "describe", str(ids["failed"]))
    assert "Hang (attempt 1" in out and "no progress for 60 s" in out
    assert "ranks 0-1:" in out and "dist.all_reduce(grad)" in out
    assert "Failure:\n  rank 1 failed:" in out and "Reason:       RuntimeError: CUDA" in out
    out = cli(url, "describe", str(ids["queued"]))
    assert "Reason:       first in line" in out and "none yet" in out
    out = cli(url, "describe", str(ids["failed"]), "--events", "2")
    assert "Events (newest 2 of 7)" in out
    d = json.loads(cli(url, "describe", str(ids["running"]), "-o", "json"))
    assert list(d) == ["job", "spec", "plan", "predicted_vs_measured", "time_split",
                       "attempts", "hang", "error", "reason", "events", "events_total",
                       "secrets", "env_hidden", "checkpoints"]
    assert [a["status"] for a in d["attempts"]] == ["failed", "running"]
    assert d["attempts"][1]["nodes"][1] == {"hostname": "h2",
                                            "node_id": "node-h2-0123456789", "ranks": [1],
                                            "gpu_ids": []}
    assert d["time_split"]["steps"] == 3
    assert d["time_split"]["measured"]["dp"] == pytest.approx(0.075)
    assert d["predicted_vs_measured"]["step_s"]["measured"] == 0.5
    h = yaml.safe_load(cli(url, "describe", str(ids["failed"]), "-o", "yaml"))["hang"]
    assert h["stacks"][0]["ranks"] == [0, 1] and h["diagnosis"] == {"never_arrived": [1]}


def test_top_per_rank_and_active_jobs(stack: tuple[str, dict[str, int]]) -> None:
    url, ids = stack
    out = cli(url, "top", str(ids["running"]), "-n", "2", "--interval", "0.1")
    frames = out.split("\n\n")
    assert len(frames) == 2
    lines = frames[0].splitlines()
    assert lines[0].startswith(f"job {ids['running']} train-big  RUNNING  tp1 pp1 dp2 zero2"
                               "  attempt 2  step 3/6")
    rank = {ln.split()[0]: ln for ln in lines[2:]}
    assert lines[1].split()[:6] == ["RANK", "TP", "PP", "DP", "NODE", "STEP"]
    # Compute is the step less its collectives; rank 1's is x1.36 its stage's median.
    assert rank["0"].split()[4:11] == ["h1", "3", "0.5", "0.4", "0", "0", "0.1"]
    assert rank["1"].split()[4:11] == ["h2", "3", "0.9", "0.85", "0", "0", "0.05"]
    assert "1.0Mi/" in rank["0"] and "ago" in rank["0"]
    assert "HEARTBEAT" in lines[1]
    beat = re.search(r" (\d+\.\d)s ago ", rank["0"])
    assert beat and float(beat.group(1)) == pytest.approx(3600, abs=120)
    assert not re.search(r"\d\.\ds ago", rank["1"])
    assert rank["1"].endswith("straggler x1.36") and rank["0"].endswith("-")
    out = cli(url, "top", "-n", "1")
    assert out.splitlines()[0].startswith("ID  NAME")
    assert [int(ln.split()[0]) for ln in out.splitlines()[1:]] == [ids["running"]]
    docs = [json.loads(ln) for ln in cli(url, "top", str(ids["running"]), "-n", "2",
                                        "--interval", "0.1", "-o", "json").splitlines()]
    assert len(docs) == 2 and docs[0]["attempt"] == 2
    assert [c["rank"] for c in docs[0]["ranks"]] == [0, 1]
    assert docs[0]["ranks"][1]["dp_s"] == 0.05 and docs[0]["ranks"][1]["straggler"]


def test_help_carries_an_example() -> None:
    for cmd in ("status", "describe", "top"):
        r = runner.invoke(app, [cmd, "--help"])
        assert r.exit_code == 0 and "Example: trident " + cmd in r.output, r.output


def test_a_job_whose_losses_were_not_finite_says_so_wherever_its_loss_is_shown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A job whose every loss was NaN, run by the controller (reports through its ingestion,
    # a fake launcher): FAILED, and its last loss reads NaN/inf in `trident status`,
    # `describe`, the API and the dashboard's jobs table, not a blank like a job that
    # reported no loss, nor a number.
    from service.cluster.data_plane import PollResult
    from tests.fakes import FakeLauncher, make, step_report
    from tests.fakes import submit as submit_spec
    from tests.waiting import DEADLINE_S, drive

    monkeypatch.setenv("TRIDENT_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TRIDENT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("TRIDENT_TOKEN", raising=False)
    settings = Settings(data_dir=tmp_path)
    with serving(create_app(settings)) as url:
        store = Store(settings.db_url)
        try:
            reports = [step_report(0, s, float("nan")) for s in (1, 2, 3)]
            launcher = FakeLauncher([[PollResult(state="running", reports=reports),
                                      PollResult(state="succeeded")]], cpus=1)
            job_id = submit_spec(store, name="diverged", parallel={"dp": 1})
            other = submit_spec(store, name="waits")
            c = make(store, launcher, tmp_path, nonfinite_loss_steps=3)
            assert drive(c, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                         DEADLINE_S) == JobState.FAILED
            c.shutdown()
        finally:
            store.close()
        [line] = [ln for ln in cli(url, "status").splitlines() if ln.startswith(str(job_id))]
        assert " 3/6 " in line and " NaN/inf " in line and "FAILED" in line, line
        assert "step 3/6, loss NaN/inf," in cli(url, "describe", str(job_id))
        got = json.loads(cli(url, "status", str(job_id), "-o", "json"))
        assert got["loss"] is None and got["loss_nonfinite"] is True, got
        token = (tmp_path / "admin.token").read_text().strip()
        rows = HTTP.get(f"{url}/ui/jobs/rows", headers={"Authorization": f"Bearer {token}"})
        assert rows.status_code == 200, rows.text
        assert '<span class="nonfinite" title="the loss of this step was NaN or infinite">' \
            'NaN/inf</span>' in rows.text
        [line] = [ln for ln in cli(url, "compare", str(job_id), str(other)).splitlines()
                  if ln.startswith(f"{job_id} ")]
        assert " 3/6 " in line and " NaN/inf " in line, line
        runs = HTTP.get(f"{url}/api/v1/compare", params={"jobs": [job_id, other]},
                        headers={"Authorization": f"Bearer {token}"}).json()["runs"]
        assert [(r["loss"], r["loss_nonfinite"]) for r in runs] == [(None, True),
                                                                     (None, False)], runs


def test_describe_and_plan_compare_show_each_memory_category_against_the_plan(
        stack: tuple[str, dict[str, int]], tmp_path: Path) -> None:
    """Per pipeline stage, each category planned against what the stage's ranks measured
    (the largest of them), with the gap; a category no rank measures says so."""
    url, ids = stack
    run = ids["running"]
    store = Store(Settings(data_dir=tmp_path).db_url)
    try:
        plan = store.get_job(job_id=run).plan
        params = int(plan.memory.params)
        record_steps(store, job_id=run, attempt=2, rows=[
            {**report(4, r), "data": {"memory": {
                "params_bytes": params + 1024 * r, "grads_bytes": 2048,
                "optimizer_bytes": 4096, "activations_peak_bytes": 8192,
                "process_peak_bytes": 1 << 29}}} for r in (0, 1)])
    finally:
        store.close()
    out = cli(url, "describe", str(run))
    assert "Memory by stage, planned against measured" in out
    assert "stage 0 (ranks 0, 1, step 4):" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("parameters"))
    assert line.split()[-2:] == ["+1.0Ki", f"{100 * 1024 / params:+.1f}%"]
    assert "not measured, logits and loss: no rank measures it apart" in out
    d = json.loads(cli(url, "describe", str(run), "-o", "json"))
    (stage,) = d["predicted_vs_measured"]["memory_by_stage"]
    cats = {c["name"]: c for c in stage["categories"]}
    assert cats["params"]["measured"] == params + 1024 and cats["params"]["gap"] == 1024
    assert cats["total"]["measured"] == 1 << 29
    assert cats["total"]["gap"] == (1 << 29) - cats["total"]["planned"]
    text = cli(url, "plan", "--compare", str(run), "--set", "parallel.dp=1")
    assert f"job {run}'s memory by stage, planned against measured:" in text
    assert "stage 0 (ranks 0, 1, step 4):" in text and "gradients" in text
    js = json.loads(cli(url, "plan", "--compare", str(run), "--set", "parallel.dp=1",
                        "--json"))
    assert js["job"]["memory_by_stage"][0]["categories"][0]["gap"] == 1024
