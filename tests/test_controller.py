"""One controller iteration at a time, with a fake worker group (the real one is in
test_e2e_ray.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import select, update

from service.cluster.data_plane import PollResult
from service.contract.hardware import get_profile
from service.contract.reports import GUARD_STOP, HeartbeatReport
from service.contract.states import JobState
from service.store import AttemptStatus, ProbeStatus, Store
from service.store.tables import JobRow
from tests.fakes import FakeLauncher, make, step_report, stopped, submit
from tests.waiting import DEADLINE_S, drive


def test_happy_path_records_metrics_and_succeeds(sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[
        PollResult(state="starting"),
        PollResult(state="running", placement={"ranks": [{"rank": 0, "node_id": "n0"}]},
                   reports=[step_report(0, 1, 5.0), step_report(1, 1, 5.0)]),
        PollResult(state="succeeded", reports=[step_report(0, 2, 4.0)]),
    ]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    assert [ch.to for ch in c.step().changes] == [JobState.PLACING]
    assert launcher.groups[0].starts == {"attempt": 1, "ckpt": str(tmp_path / f"job-{job_id}")}
    assert c.step().changes == []  # still starting
    assert [ch.to for ch in c.step().changes] == [JobState.RUNNING]
    assert [ch.to for ch in c.step().changes] == [JobState.SUCCEEDED]
    assert stopped(c, launcher.groups[0])
    assert [(m.step, m.loss) for m in sqlite_store.list_metrics(job_id=job_id)] == [
        (1, 5.0), (2, 4.0)]
    attempts = sqlite_store.list_attempts(job_id=job_id)
    assert attempts[0].status == AttemptStatus.SUCCEEDED
    assert attempts[0].placement["ranks"][0]["node_id"] == "n0"


def test_auto_job_runs_its_stored_spec_as_it_is(sqlite_store: Store, tmp_path: Path) -> None:
    """`parallel: auto` was resolved at submission; the launcher gets the stored spec."""
    launcher = FakeLauncher([[PollResult(state="starting")]])
    job_id = submit(sqlite_store, parallel="auto",
                    cluster={"gpu": "cpu", "nodes": 1, "gpus_per_node": 2})
    job = sqlite_store.get_job(job_id=job_id)
    assert job.plan.chosen_by == "search" and job.spec.parallel != "auto"
    make(sqlite_store, launcher, tmp_path).step()
    started = launcher.started[0]
    assert started["spec"] == job.spec
    assert started["spec"].layout == job.plan.layout.parallel
    assert started["spec"].train.micro_batch == job.plan.layout.micro_batch
    assert started["plan"] == job.plan


def test_worker_exception_fails_the_job_with_traceback(sqlite_store: Store,
                                                       tmp_path: Path) -> None:
    tb = 'Traceback (most recent call last):\n  File "train.py"\nRuntimeError: boom'
    launcher = FakeLauncher([[PollResult(state="running"),
                              PollResult(state="failed", error=tb, failed_ranks=[1])]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step(), c.step()
    job = sqlite_store.get_job(job_id=job_id)
    assert job.state == JobState.FAILED and "RuntimeError: boom" in (job.error or "")
    last = sqlite_store.list_events(job_id=job_id)[-1]
    assert last.data["to"] == "FAILED" and "rank(s) [1] failed" in last.message
    assert "RuntimeError: boom" in last.message


def test_failure_with_retries_restarts_a_new_attempt(sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[PollResult(state="running"), PollResult(state="failed", error="x")],
                             [PollResult(state="running"), PollResult(state="succeeded")]])
    job_id = submit(sqlite_store, max_retries=1)
    c = make(sqlite_store, launcher, tmp_path)
    # The failed attempt's group is stopped on a thread beside the loop; the next attempt
    # starts once it is gone, a pass or more later.
    drive(c, sqlite_store, job_id, {JobState.SUCCEEDED, JobState.FAILED}, DEADLINE_S)
    job = sqlite_store.get_job(job_id=job_id)
    assert job.state == JobState.SUCCEEDED and job.attempts == 2
    states = [e.data["to"] for e in sqlite_store.list_events(job_id=job_id) if e.kind == "state"]
    assert states == ["QUEUED", "PLACING", "RUNNING", "RESTARTING", "PLACING", "RUNNING",
                      "SUCCEEDED"]
    assert launcher.groups[1].starts["attempt"] == 2


def test_an_attempt_the_training_guard_stopped_is_not_retried(sqlite_store: Store,
                                                                tmp_path: Path) -> None:
    tb = ("Traceback (most recent call last):\n  File \"train.py\"\nworkers.trainer.guard."
          f"GuardStop: {GUARD_STOP}loss spike: 812 is above 5 x the median 5.1")
    launcher = FakeLauncher([[PollResult(state="running"),
                              PollResult(state="failed", error=tb, failed_ranks=[0, 1])]])
    job_id = submit(sqlite_store, max_retries=2)
    c = make(sqlite_store, launcher, tmp_path)
    drive(c, sqlite_store, job_id, {JobState.FAILED, JobState.RESTARTING}, DEADLINE_S)
    job = sqlite_store.get_job(job_id=job_id)
    assert job.state == JobState.FAILED and job.attempts == 1
    assert "loss spike: 812" in (job.error or "")
    assert "not retried: the training guard stopped it" in (job.error or "")


def test_cancel_stops_the_group(sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[PollResult(state="running")]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    sqlite_store.request_cancel(job_id=job_id)
    c.step()
    assert launcher.groups[0].cancelled and stopped(c, launcher.groups[0])
    assert sqlite_store.get_job(job_id=job_id).state == JobState.CANCELLED


def test_invalid_reports_are_dropped_with_a_warning(sqlite_store: Store, tmp_path: Path) -> None:
    bad = {"kind": "step", "rank": -1, "step": 1, "step_time_s": 0.1, "tokens_per_s": 1.0}
    nan = step_report(0, 1, float("nan"))
    launcher = FakeLauncher([[PollResult(state="running", reports=[bad, nan])]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    assert [(m.step, m.loss) for m in sqlite_store.list_metrics(job_id=job_id)] == [(1, None)]
    warnings = [e for e in sqlite_store.list_events(job_id=job_id) if e.kind == "warning"]
    assert len(warnings) == 1 and "rank" in warnings[0].message


def test_group_that_never_starts_times_out(sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[PollResult(state="starting")]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path, start_timeout_s=0.0)
    c.step(), c.step()
    job = sqlite_store.get_job(job_id=job_id)
    assert job.state == JobState.FAILED and "did not start within" in (job.error or "")
    assert stopped(c, launcher.groups[0])


def test_job_too_big_for_the_cluster_fails_with_the_arithmetic(sqlite_store: Store,
                                                               tmp_path: Path) -> None:
    job_id = submit(sqlite_store, resources={"cpus_per_worker": 4})
    c = make(sqlite_store, FakeLauncher([], cpus=4), tmp_path)
    c.step()
    job = sqlite_store.get_job(job_id=job_id)
    assert job.state == JobState.FAILED and "need 8 CPUs" in (job.error or "")


def test_higher_priority_job_is_admitted_first(sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[PollResult(state="running")]], cpus=1)
    low = submit(sqlite_store, resources={"cpus_per_worker": 0.5})
    high = submit(sqlite_store, priority=10, resources={"cpus_per_worker": 0.5})
    make(sqlite_store, launcher, tmp_path).step()
    assert sqlite_store.get_job(job_id=high).state == JobState.PLACING
    assert sqlite_store.get_job(job_id=low).state == JobState.QUEUED


def test_orphaned_running_job_does_not_stay_running(sqlite_store: Store, tmp_path: Path) -> None:
    job_id = submit(sqlite_store)
    sqlite_store.transition(job_id=job_id, to=JobState.PLACING, message="x")
    sqlite_store.start_attempt(job_id=job_id)
    sqlite_store.transition(job_id=job_id, to=JobState.RUNNING, message="x")
    make(sqlite_store, FakeLauncher([]), tmp_path).step()  # a fresh controller
    job = sqlite_store.get_job(job_id=job_id)
    assert job.state == JobState.FAILED and "controller restarted" in (job.error or "")


def hb(rank: int, step: int, age: float, collective: str | None = None,
       group: list[int] | None = None) -> HeartbeatReport:
    return HeartbeatReport(rank=rank, step=step, phase="forward", collective=collective,
                           dim="dp" if collective else None, group=group, time=0.0, age_s=age)


def test_hang_is_diagnosed_with_stacks_and_fails_the_attempt(sqlite_store: Store,
                                                             tmp_path: Path) -> None:
    stuck = PollResult(state="running", heartbeats={
        0: hb(0, 3, 5.0, "all_reduce", [0, 1]), 1: hb(1, 3, 5.0)})
    launcher = FakeLauncher([[PollResult(state="running"), stuck]])
    job_id = submit(sqlite_store, monitor={"hang_timeout_s": 2.0})
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step(), c.step()
    job = sqlite_store.get_job(job_id=job_id)
    assert job.state == JobState.FAILED and (job.error or "").startswith("hung:")
    events = sqlite_store.list_events(job_id=job_id)
    hang = next(e for e in events if e.kind == "hang")
    assert hang.data["never_arrived"] == [1]
    assert "ranks [0] wait in all_reduce of dp group [0, 1]" in hang.message
    assert stopped(c, launcher.groups[0])
    # The stacks (up to 10 s of waiting for the ranks) were taken on the teardown's thread,
    # not in a pass; the pass that reaps the teardown stores them.
    assert [t.startswith("teardown-") for t in launcher.groups[0].stack_threads] == [True]
    c.step()
    events = sqlite_store.list_events(job_id=job_id)
    assert sorted(e.data["rank"] for e in events if e.kind == "stacks") == [0, 1]


def test_recent_heartbeats_are_not_a_hang(sqlite_store: Store, tmp_path: Path) -> None:
    fresh = PollResult(state="running", heartbeats={0: hb(0, 3, 0.1, "all_reduce", [0, 1]),
                                                    1: hb(1, 3, 0.1)})
    launcher = FakeLauncher([[PollResult(state="running"), fresh]])
    job_id = submit(sqlite_store, monitor={"hang_timeout_s": 2.0})
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step(), c.step()
    assert sqlite_store.get_job(job_id=job_id).state == JobState.RUNNING


def timed_report(rank: int, step: int, step_s: float) -> dict[str, Any]:
    return {**step_report(rank, step, 3.0), "step_time_s": step_s,
            "timed": True, "comm": {"dp": {"all_reduce": {"time_s": 0.01, "bytes": 4096.0,
                                                          "calls": 1.0}}}}


def test_straggler_is_named_once(sqlite_store: Store, tmp_path: Path) -> None:
    reports = [timed_report(r, s, 0.5 if r == 1 else 0.1) for s in range(1, 7) for r in (0, 1)]
    launcher = FakeLauncher([[PollResult(state="running", reports=reports,
                                         placement={"ranks": [{"rank": 0, "node_id": "a"},
                                                              {"rank": 1, "node_id": "b"}]}),
                              PollResult(state="running")]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step(), c.step()
    stragglers = [e for e in sqlite_store.list_events(job_id=job_id) if e.kind == "straggler"]
    assert len(stragglers) == 1
    assert stragglers[0].data["rank"] == 1 and stragglers[0].data["node"] == "b"
    assert "rank 1 (node b" in stragglers[0].message


def probe_reports(busbw: float) -> list[dict[str, Any]]:
    """Rank 0 reports the all-reduce of DP group [0, 1] at 64 MiB; rank 1 reports no group."""
    row = {"dim": "dp", "group": [0, 1], "op": "all_reduce", "bytes": 64 << 20, "time_s": 0.1,
           "algbw": busbw, "busbw": busbw}
    return [{"kind": "probe", "rank": 0, "rows": [row]}, {"kind": "probe", "rank": 1, "rows": []}]


def test_probe_reports_of_all_ranks_are_stored_and_judged(sqlite_store: Store,
                                                          tmp_path: Path) -> None:
    launcher = FakeLauncher([[PollResult(state="running", reports=probe_reports(1e6))]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    (probe,) = sqlite_store.list_probes(job_id=job_id)
    assert probe.status == ProbeStatus.DONE and probe.results[0]["busbw"] == 1e6
    assert probe.results[0]["expected_busbw"] > 1e6
    assert len(probe.summary["slow_groups"]) == 1
    kinds = [e.kind for e in sqlite_store.list_events(job_id=job_id)]
    assert "probe" in kinds and "warning" in kinds


def test_probe_is_judged_against_the_profile_trident_probe_calibrated(sqlite_store: Store,
                                                                      tmp_path: Path) -> None:
    # 1 MB/s is far below the built-in cpu profile's link (flagged in the test above), but on
    # a cluster whose calibrated cpu profile measured a 1.5 MB/s link it is as expected.
    datasheet = get_profile("cpu")
    slow_link = replace(datasheet, intra_node_bw=1.5e6, inter_node_bw=1.5e6)
    sqlite_store.save_profile(name="cpu", profile=slow_link.to_json())
    launcher = FakeLauncher([[PollResult(state="running", reports=probe_reports(1e6))]])
    job_id = submit(sqlite_store)
    assert sqlite_store.get_job(job_id=job_id).spec.target.gpu == "cpu"
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    (probe,) = sqlite_store.list_probes(job_id=job_id)
    assert probe.summary["slow_groups"] == []
    assert probe.results[0]["expected_busbw"] < 1.5e6 < datasheet.intra_node_bw
    assert "warning" not in [e.kind for e in sqlite_store.list_events(job_id=job_id)]


def test_tp_group_across_a_pcie_link_is_warned_at_placement(sqlite_store: Store,
                                                            tmp_path: Path) -> None:
    sqlite_store.upsert_nodes(nodes=[{"node_id": "n0", "hostname": "gpu0", "accelerator": "gpu",
                                      "topology": {"GPU0": {"GPU0": "X", "GPU1": "PHB"},
                                                   "GPU1": {"GPU0": "PHB", "GPU1": "X"}}}])
    placement = {"ranks": [{"rank": r, "node_id": "n0", "gpu_ids": [str(r)]} for r in (0, 1)]}
    launcher = FakeLauncher([[PollResult(state="running", placement=placement)]])
    launcher.inventory = lambda: [{"node_id": "n0", "hostname": "gpu0",  # type: ignore
                                   "accelerator": "gpu",
                                   "topology": {"GPU0": {"GPU0": "X", "GPU1": "PHB"},
                                                "GPU1": {"GPU0": "PHB", "GPU1": "X"}}}]
    job_id = submit(sqlite_store, parallel={"tp": 2, "dp": 1}, train={
        "steps": 2, "global_batch": 8, "micro_batch": 2})
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    warnings = [e.message for e in sqlite_store.list_events(job_id=job_id) if e.kind == "warning"]
    assert warnings == ["TP group [0, 1] on node n0 crosses slow links: GPU0-GPU1 PHB"]


def test_cluster_probe_runs_are_started_and_calibrate_a_profile(sqlite_store: Store,
                                                                tmp_path: Path) -> None:
    rows = [{"dim": "tp", "group": [0, 1], "op": "all_reduce", "bytes": 1 << 20,
             "time_s": 0.1, "algbw": 2e8, "busbw": 2e8}]
    reports = [{"kind": "cluster_probe", "rank": r, "node_id": "n0",
                "matmul_flops": {"fp32": 4e10}, "rows": rows if r == 0 else []} for r in (0, 1)]
    launcher = FakeLauncher([[PollResult(state="running", reports=reports),
                              PollResult(state="succeeded")],
                             [PollResult(state="failed", error="rank 1 died")]])
    good = sqlite_store.create_probe(scope="cluster", request={
        "ranks_per_node": 2, "max_bytes": 1 << 20, "profile": "cpu"})
    c = make(sqlite_store, launcher, tmp_path)
    c.step()
    assert launcher.groups[0].starts == {"probe": good.id}
    bad = sqlite_store.create_probe(scope="cluster", request={
        "ranks_per_node": 2, "max_bytes": 1 << 20, "profile": "cpu"})
    c.step(), c.step()
    assert all(stopped(c, g) for g in launcher.groups)
    done = sqlite_store.get_probe(probe_id=good.id)
    assert done.status == "done" and done.summary["links"]["intra_node_bw"] == 2e8
    assert sqlite_store.get_profile(name="cpu").profile.intra_node_bw == 2e8
    failed = sqlite_store.get_probe(probe_id=bad.id)
    assert failed.status == "failed" and failed.error == "rank 1 died"


def test_a_pass_leaves_the_rank_rows_of_running_jobs_unread(sqlite_store: Store,
                                                             tmp_path: Path) -> None:
    """Every pass reads the plan of every active job, whose rank rows (one per rank) only a
    start and the ranks grid need: a pass over running jobs never validates them, so rows
    that cannot validate stop none of it."""
    launcher = FakeLauncher([[PollResult(state="running")] for _ in range(3)])
    ids = [submit(sqlite_store) for _ in range(3)]
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    assert {sqlite_store.get_job(job_id=i).state for i in ids} == {JobState.RUNNING}
    with sqlite_store.engine.begin() as conn:
        for i in ids:
            plan = conn.execute(select(JobRow.plan).where(JobRow.id == i)).scalar_one()
            rows = [{"rank": "not a row"}] * len(plan["rank_layout"])
            conn.execute(update(JobRow).where(JobRow.id == i)
                         .values(plan={**plan, "rank_layout": rows}))
    for _ in range(3):
        c.step()
    assert {sqlite_store.get_job(job_id=i).state for i in ids} == {JobState.RUNNING}
    assert all(g.polls >= 4 for g in launcher.groups)
    with pytest.raises(ValidationError):  # they would not have validated
        sqlite_store.get_job(job_id=ids[0]).plan.rank_layout[0]


@pytest.mark.parametrize(("losses", "ends"), [
    ([1.0, float("nan"), float("inf"), float("nan")], JobState.FAILED),  # the last 3
    ([float("nan"), float("nan"), 2.0], JobState.SUCCEEDED),  # recovered: the last is finite
    ([float("nan"), 1.0, float("nan"), float("nan")], JobState.SUCCEEDED),  # 1 of the last 3
    ([None, None, None], JobState.SUCCEEDED),  # no loss reported (a custom entrypoint's)
], ids=["last-3-nan", "finite-last", "one-finite-in-window", "no-loss"])
def test_a_job_whose_last_losses_are_not_finite_does_not_succeed(
        sqlite_store: Store, tmp_path: Path, losses: list[float | None], ends: JobState) -> None:
    reports = [step_report(0, s, 0.0) | {"loss": loss} for s, loss in enumerate(losses, 1)]
    launcher = FakeLauncher([[PollResult(state="running", reports=reports),
                              PollResult(state="succeeded")]], cpus=1)
    job_id = submit(sqlite_store, parallel={"dp": 1})
    c = make(sqlite_store, launcher, tmp_path, nonfinite_loss_steps=3)
    assert drive(c, sqlite_store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 DEADLINE_S) == ends
    error = sqlite_store.get_job(job_id=job_id).error
    if ends == JobState.FAILED:
        assert error is not None and error.startswith(
            f"the last 3 losses (steps 2-{len(losses)} of attempt 1) were not finite")
        assert "nonfinite_loss_steps 3" in error
