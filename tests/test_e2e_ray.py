"""End to end on a real local Ray: REST submit -> store -> controller -> Ray placement group
-> one actor per rank -> DeepSpeed ZeRO-2 over gloo -> metrics -> API.

The tests of numbers (losses, the collectives' attribution, the probe, checkpoints) train with
DeepSpeed; those of the orchestration (hangs, stragglers, cancels, failures, what each rank is
sent, re-attaching) run the light rank program (`program: light`, `workers.rank.light`),
whose ranks report, beat, meet in a collective and fail on cue without torch."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

from sqlalchemy import update  # noqa: E402

from service.contract.states import JobState  # noqa: E402
from service.control.controller import Controller  # noqa: E402
from service.store import AttemptStatus, Store  # noqa: E402
from service.store.tables import JobRow  # noqa: E402
from tests.conftest import tiny_spec  # noqa: E402
from tests.waiting import drive, drive_until  # noqa: E402
from workers.launch.launcher import RayLauncher  # noqa: E402
from workers.monitor.comm_probe import job_sizes  # noqa: E402

pytestmark = pytest.mark.slow


CANCEL_WITHIN_S = 5.0
"""A cancel request is answered with CANCELLED within this, by the store's own timestamps:
the request's event (written by the API) and the state's (written by the pass that sees it)."""


def cancel_delay_s(store: Store, job_id: int) -> float:
    """Seconds from the job's cancel request to its CANCELLED state, by the store's events."""
    events = store.list_events(job_id=job_id, limit=1000)
    asked = next(e.time for e in events if e.kind == "cancel")
    done = next(e.time for e in events if e.kind == "state" and e.data["to"] == "CANCELLED")
    return (done - asked).total_seconds()


def no_placement_groups_left(controller: Controller) -> bool:
    """Whether every group is stopped and released, once the teardowns have finished."""
    drive_until(controller, lambda: controller.teardowns.pending == 0, 60, "teardowns done")
    controller.step()  # reaps the last of them
    return not [pg for pg in ray.util.placement_group_table().values()
                if pg["state"] != "REMOVED"]


def test_tiny_zero2_job_trains_to_success(stack) -> None:
    client, store, controller = stack
    r = client.post("/api/v1/jobs", json=tiny_spec(train={
        "steps": 16, "global_batch": 8, "micro_batch": 2, "precision": "fp32", "lr": 0.003},
        monitor={"probe": True, "probe_max_bytes": 64 << 10}))
    assert r.status_code == 201
    job_id = r.json()["id"]
    assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 240) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error

    metrics = client.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"]
    assert [m["step"] for m in metrics] == list(range(1, 17))
    assert all(m["step_time_s"] > 0 and m["tokens_per_s"] > 0 for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    rank1 = client.get(f"/api/v1/jobs/{job_id}/metrics", params={"rank": 1}).json()["items"]
    assert [m["loss"] for m in rank1] == pytest.approx([m["loss"] for m in metrics])

    attempt = store.list_attempts(job_id=job_id)[0]
    assert attempt.status == AttemptStatus.SUCCEEDED
    assert [r["rank"] for r in attempt.placement["ranks"]] == [0, 1]
    kinds = [e["kind"] for e in client.get(f"/api/v1/jobs/{job_id}/events").json()["items"]]
    assert "placement" in kinds and "rendezvous" in kinds
    assert controller.teardowns.wait(60)  # the group is stopped beside the controller's loop
    assert not [pg for pg in ray.util.placement_group_table().values()
                if pg["state"] != "REMOVED"]

    # The health monitor: the probe ran on the DP group and the step's collectives were
    # attributed to dp (ZeRO-2's gradient reduction and parameter all-gather).
    comm = client.get(f"/api/v1/jobs/{job_id}/comm").json()
    dp = comm["dims"]["dp"]
    assert dp["time_s_per_step"] > 0 and dp["bytes_per_step"] > 0 and 0 < dp["fraction"] < 1
    assert {"tp", "pp"}.isdisjoint(k for k, v in comm["dims"].items() if v["bytes_per_step"])
    ops = {row["op"] for row in comm["probe"]}
    assert {"all_reduce", "all_gather", "reduce_scatter"} <= ops
    assert all(row["group"] == [0, 1] and row["busbw"] > 0 for row in comm["probe"])
    assert max(row["bytes"] for row in comm["probe"]) == 64 << 10
    assert {row["bytes"] for row in comm["probe"]} == set(job_sizes(64 << 10))
    # Predicted next to measured, on the `cpu` profile. How close the step times come depends
    # on the machine's load: `python bench/bench_cpu_trainer.py --demo` prints that ratio.
    # The bytes of the model states do not depend on load.
    pvm = client.get(f"/api/v1/jobs/{job_id}").json()["predicted_vs_measured"]
    print("predicted vs measured:", pvm)
    assert pvm["steps_measured"] == 13
    step = pvm["step_s"]
    assert step["predicted"] > 0 and step["measured"] > 0, step
    assert step["ratio"] == pytest.approx(step["measured"] / step["predicted"])
    assert 0.95 <= pvm["model_state_bytes"]["ratio"] <= 1.05, pvm["model_state_bytes"]
    nodes = client.get("/api/v1/cluster").json()["nodes"]
    assert nodes and nodes[0]["info"]["accelerator"] == "cpu"


HANG_TIMEOUT_S = 15
"""Long enough that start-up on a loaded 2-core machine (a rank starting while a peer waits in
a collective) is not taken for a hang; short enough to keep the test quick."""


def test_hung_rank_is_named_within_the_timeout(stack) -> None:
    """Rank 1 sleeps in step 3 before its first collective; rank 0 waits for it there."""
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=tiny_spec(
        program="light",
        train={"steps": 50, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        monitor={"probe": False, "hang_timeout_s": HANG_TIMEOUT_S},
        faults=[{"kind": "hang", "rank": 1, "step": 3, "seconds": 180}])).json()["id"]
    drive(controller, store, job_id, {JobState.RUNNING}, 180)

    def trained_step_2() -> bool:
        job = store.get_job(job_id=job_id)
        assert not job.state.terminal, f"job ended before the fault fired: {job.error}"
        return any(m.step == 2 for m in store.list_metrics(job_id=job_id, rank=1))

    drive_until(controller, trained_step_2, 120, "step 2 of rank 1")
    assert drive(controller, store, job_id, {JobState.FAILED}, 120) == JobState.FAILED
    # The ranks' stacks are taken where the group is stopped, beside the loop, and stored
    # by the pass that reaps that teardown.
    drive_until(controller, lambda: any(e.kind == "stacks" for e in store.list_events(
        job_id=job_id)), 60, "the hung ranks' stacks")
    events = client.get(f"/api/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["items"]
    hang = next(e for e in events if e["kind"] == "hang")
    # Named once no rank moved for the timeout, soon after it: `stalled_s` is measured by the
    # controller itself. The margin is generous because load slows the polls, not the verdict.
    assert HANG_TIMEOUT_S <= hang["data"]["stalled_s"] < HANG_TIMEOUT_S + 30, hang["data"]
    assert hang["data"]["never_arrived"] == [1]
    (waiting,) = hang["data"]["waiting"]
    assert waiting["waiting"] == [0] and waiting["group"] == [0, 1] and waiting["dim"] == "dp"
    stacks = {e["data"]["rank"]: e["data"]["stacks"] for e in events if e["kind"] == "stacks"}
    assert "_before_collective" in stacks[1] and "time.sleep" in stacks[1]
    assert client.get(f"/api/v1/jobs/{job_id}").json()["error"].startswith("hung:")


def test_failed_attempt_restarts_from_the_newest_checkpoint(stack) -> None:
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=tiny_spec(
        train={"steps": 8, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        # Saved synchronously: the step-4 tag is complete with step 4 (a tag saved in the
        # background is complete once its files are, up to steps later: docs/checkpoints.md).
        checkpoint={"every_steps": 2, "async": False}, max_retries=1, monitor={"probe": False},
        faults=[{"kind": "fail", "rank": 1, "step": 6, "attempt": 1}])).json()["id"]
    assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 300) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
    job = client.get(f"/api/v1/jobs/{job_id}").json()
    assert job["attempts"] == 2
    states = [e["data"]["to"] for e in client.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
              if e["kind"] == "state"]
    assert states == ["QUEUED", "PLACING", "RUNNING", "RESTARTING", "PLACING", "RUNNING",
                      "SUCCEEDED"]
    second = [m.step for m in store.list_metrics(job_id=job_id, attempt=2)]
    assert second == [5, 6, 7, 8]  # resumed after the step-4 checkpoint
    first = {m.step: m.loss for m in store.list_metrics(job_id=job_id, attempt=1)}
    resumed = {m.step: m.loss for m in store.list_metrics(job_id=job_id, attempt=2)}
    assert resumed[5] == pytest.approx(first[5], rel=1e-6)  # fp32: same data, same state


def test_slow_rank_is_reported_as_a_straggler(stack) -> None:
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=tiny_spec(
        program="light",
        train={"steps": 12, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        monitor={"probe": False, "straggler_min_steps": 4},
        faults=[{"kind": "slow", "rank": 1, "step": 3, "seconds": 0.3}])).json()["id"]
    assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 300) == JobState.SUCCEEDED
    events = client.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
    stragglers = [e for e in events if e["kind"] == "straggler"]
    assert [e["data"]["rank"] for e in stragglers] == [1]
    node = store.list_attempts(job_id=job_id)[0].placement["ranks"][1]["node_id"]
    assert stragglers[0]["data"]["node"] == node and f"rank 1 (node {node}" in \
        stragglers[0]["message"]


def test_a_pipeline_job_probes_again_during_training_at_step_boundaries(stack) -> None:
    """`monitor.probe_every_s`: the ranks of a pp2 job (the built-in trainer) probe again
    between steps, every rank at the same boundary (else they would block each other in the
    probe), and train on; each round is stored with the step it followed."""
    client, store, controller = stack
    r = client.post("/api/v1/jobs", json=tiny_spec(
        parallel={"tp": 1, "pp": 2, "dp": 1},
        train={"steps": 150, "global_batch": 4, "micro_batch": 2, "precision": "fp32"},
        monitor={"probe_max_bytes": 64 << 10, "probe_every_s": 5},
        # Steps of at least 0.1 s: the training lasts 15 s or more however fast the machine,
        # so rounds come during it (the tiny model's own steps can take 5 s all told).
        faults=[{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.1}]))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 300) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
    metrics = client.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"]
    assert [m["step"] for m in metrics] == list(range(1, 151))
    probes = sorted(store.list_probes(job_id=job_id), key=lambda p: p.summary["round"])
    rounds = [(p.summary["round"], p.summary["step"]) for p in probes]
    print("probe rounds (round, after step):", rounds)
    assert rounds[0] == (0, None) and len(rounds) >= 2, rounds
    assert [n for n, _ in rounds] == list(range(len(rounds)))
    steps = [s for _, s in rounds[1:]]
    assert steps == sorted(set(steps)) and all(1 <= s <= 150 for s in steps), rounds
    for p in probes[1:]:  # no TP or DP group here: the pipeline's pair; one host: no pairs
        assert {(r["dim"], tuple(r["group"]), r["op"]) for r in p.results} == {
            ("pp", (0, 1), "send_recv")}, p.results
        assert p.summary["slow_hosts"] == [] and p.summary["host_pairs"] == []
    kinds = [e.kind for e in store.list_events(job_id=job_id, limit=1000)]
    assert kinds.count("probe") == 1 and "slow_link" not in kinds


def test_cluster_probe_calibrates_the_cpu_profile(stack) -> None:
    client, store, controller = stack
    probe = client.post("/api/v1/probes", json={"ranks_per_node": 2,
                                                "max_bytes": 1 << 20}).json()
    drive_until(controller, lambda: store.get_probe(probe_id=probe["id"]).status
                not in ("pending", "running"), 120, f"probe {probe['id']} finished")
    done = client.get(f"/api/v1/probes/{probe['id']}").json()
    assert done["status"] == "done", done["error"]
    assert done["summary"]["matmul_flops"]["fp32"] > 1e8
    assert done["summary"]["links"]["intra_node_bw"] > 0
    profile = client.get("/api/v1/cluster").json()["profiles"]["cpu"]
    measured = done["summary"]["matmul_flops"]["fp32"]
    assert profile["peak_flops_fp32"] == pytest.approx(measured / profile["gemm_eff_max"])
    assert profile["intra_node_bw"] == done["summary"]["links"]["intra_node_bw"]
    assert profile["probe_id"] == probe["id"]


def test_cancel_is_done_in_one_pass_and_stops_the_workers(stack) -> None:
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=tiny_spec(program="light", train={
        "steps": 100000, "global_batch": 8, "micro_batch": 2, "precision": "fp32"})).json()["id"]
    drive(controller, store, job_id, {JobState.RUNNING}, 180)
    drive_until(controller, lambda: bool(store.list_metrics(job_id=job_id)), 120,
                "a finished step")

    assert client.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 202
    # CANCELLED in the pass that sees the request; the workers stop at their next step, or
    # are killed after the 5 s grace, beside the controller's loop. Counted in passes, not
    # seconds: a pass's length is the machine's load.
    controller.step()
    assert store.get_job(job_id=job_id).state == JobState.CANCELLED
    delay = cancel_delay_s(store, job_id)
    print("cancel request -> CANCELLED (s):", delay)
    assert delay < CANCEL_WITHIN_S  # the pass reads and writes the store; it polls no group
    assert not controller.running
    assert no_placement_groups_left(controller)
    # What the ranks reported before they stopped is stored (the last of it from the
    # teardown's final poll), each step once.
    for rank in (0, 1):
        steps = [m.step for m in store.list_metrics(job_id=job_id, rank=rank)]
        assert steps == list(range(1, len(steps) + 1)), (rank, steps)


def test_four_started_jobs_cancelled_at_once_are_cancelled_in_one_pass(stack) -> None:
    """Four running jobs (a rank each, of 0.5 CPU on the 2-CPU cluster), cancelled together:
    all are CANCELLED by the next pass, and their groups are all released. One rank a job:
    what is counted is jobs and groups, and each rank is seconds of CPU to start."""
    client, store, controller = stack
    spec = tiny_spec(program="light", train={"steps": 100000, "global_batch": 8,
                                             "micro_batch": 2, "precision": "fp32"},
                     monitor={"probe": False},
                     parallel={"tp": 1, "pp": 1, "dp": 1, "zero": 2})
    jobs = [client.post("/api/v1/jobs", json=spec).json()["id"] for _ in range(4)]
    drive_until(controller, lambda: all(store.list_metrics(job_id=j) for j in jobs), 600,
                "a finished step of each of the four jobs")

    for j in jobs:
        assert client.post(f"/api/v1/jobs/{j}/cancel").status_code == 202
    # All four in the one pass that sees the requests: no teardown (5 s grace each) runs
    # inside the loop. Counted in passes, not seconds: a pass's length is the machine's load.
    controller.step()
    assert {j: store.get_job(job_id=j).state for j in jobs} == \
        {j: JobState.CANCELLED for j in jobs}
    delays = {j: cancel_delay_s(store, j) for j in jobs}
    print("cancel request -> CANCELLED (s):", delays)
    assert all(d < CANCEL_WITHIN_S for d in delays.values()), delays
    # The groups are stopped beside the loop: a later pass reaps them.
    assert not [e for j in jobs for e in store.list_events(job_id=j, limit=1000)
                if e.kind == "teardown"]
    assert no_placement_groups_left(controller)
    for j in jobs:
        freed = [e for e in store.list_events(job_id=j, limit=1000) if e.kind == "teardown"]
        assert len(freed) == 1, [e.message for e in store.list_events(job_id=j, limit=1000)]


def test_worker_exception_fails_the_job_with_its_traceback(stack) -> None:
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=tiny_spec(
        program="light", entrypoint="tests.entrypoints:explode")).json()["id"]
    assert drive(controller, store, job_id, {JobState.FAILED, JobState.SUCCEEDED},
                 180) == JobState.FAILED
    job = client.get(f"/api/v1/jobs/{job_id}").json()
    assert "RuntimeError: rank 1 exploded on purpose" in job["error"]
    assert "Traceback" in job["error"]


def test_each_rank_is_sent_its_row_of_the_stored_plan(stack) -> None:
    """The launcher sends every rank its row of the plan as stored: its coordinates, its
    layers, every stage's layers and its groups. A stored split other than the one the
    planner would make now is the one the ranks get: they do not work it out again."""
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=tiny_spec(
        model={"preset": "gpt-tiny", "layers": 5},
        parallel={"tp": 1, "pp": 2, "dp": 1, "partition": "parameters"},
        monitor={"probe": False}, program="light",
        entrypoint="tests.entrypoints:rows")).json()["id"]
    planned = store.get_job(job_id=job_id).plan.to_json()
    stored = [[[0, 1]], [[1, 5]]]
    assert [r["layers"] for r in planned["rank_layout"]] != stored
    with store.engine.begin() as c:  # before the controller's first pass reads it
        c.execute(update(JobRow).where(JobRow.id == job_id).values(plan={
            **planned, "rank_layout": [{**r, "layers": stored[r["pp"]]}
                                       for r in planned["rank_layout"]]}))
    assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 180) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
    sent = {m.rank: {k: json.loads(v) for k, v in m.data["custom"].items()}
            for m in store.list_metrics(job_id=job_id, rank=None)}
    assert sent == {
        0: {"coords": [0, 0, 0], "layers": [[0, 1]], "stages": stored,
            "groups": {"tp": [0], "pp": [0, 1], "dp": [0]}},
        1: {"coords": [1, 0, 0], "layers": [[1, 5]], "stages": stored,
            "groups": {"tp": [1], "pp": [0, 1], "dp": [1]}}}


def test_a_group_placed_but_not_launched_is_reattached_without_a_retry(stack) -> None:
    """The controller that placed a group died before it launched the ranks (the job still
    PLACING): the next controller re-attaches to the group where it was, launches its ranks
    and the job succeeds as attempt 1, though it allows no retry."""
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=tiny_spec(program="light", train={
        "steps": 4, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        monitor={"probe": False})).json()["id"]
    controller.step()  # admitted: its placement group and actors are created
    assert store.get_job(job_id=job_id).state == JobState.PLACING
    controller.running.clear()  # this controller is gone; its group is detached

    successor = Controller(store, RayLauncher(light_ranks=True,
                                              namespace=controller.launcher.namespace),
                           checkpoint_root=controller.checkpoint_root,
                           start_timeout_s=120, cancel_grace_s=5)
    try:
        drive(successor, store, job_id, {JobState.SUCCEEDED, JobState.FAILED}, 240)
        job = store.get_job(job_id=job_id)
        assert job.state == JobState.SUCCEEDED and job.attempts == 1, job.error
        assert any(e.kind == "reattach" for e in store.list_events(job_id=job_id))
        assert [m.step for m in store.list_metrics(job_id=job_id)] == [1, 2, 3, 4]
    finally:
        successor.shutdown(stop_jobs=True)


@pytest.mark.parametrize("ending", ["cancelled", "failed"])
def test_a_group_whose_job_ended_while_no_controller_watched_is_stopped(stack,
                                                                        ending: str) -> None:
    """The job of a detached group was cancelled, or ended in the store, while no controller
    ran: the next controller's first pass stops the group on Ray (ranks and placement)."""
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=tiny_spec(program="light", train={
        "steps": 100000, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        monitor={"probe": False})).json()["id"]
    drive(controller, store, job_id, {JobState.RUNNING}, 180)
    controller.running.clear()  # this controller is gone; its group trains on, detached
    group = f"trident-job{job_id}-a1"

    def on_ray() -> tuple[list[str], list[str]]:
        actors = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["name"].startswith(group + "-r"))
        pgs = [pg["name"] for pg in ray.util.placement_group_table().values()
               if pg.get("name") == group and pg["state"] != "REMOVED"]
        return actors, pgs

    assert on_ray() == ([f"{group}-r0", f"{group}-r1"], [group])
    if ending == "cancelled":
        assert client.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 202
    else:
        store.transition(job_id=job_id, to=JobState.FAILED, message="ended by an operator",
                         error="ended by an operator")
    successor = Controller(store, RayLauncher(light_ranks=True,
                                              namespace=controller.launcher.namespace),
                           checkpoint_root=controller.checkpoint_root,
                           start_timeout_s=120, cancel_grace_s=5)
    try:
        successor.step()
        assert on_ray() == ([], [])
        assert not successor.running
        assert store.get_job(job_id=job_id).state == (
            JobState.CANCELLED if ending == "cancelled" else JobState.FAILED)
    finally:
        successor.shutdown(stop_jobs=True)
