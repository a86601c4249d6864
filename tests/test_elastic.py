"""Elastic re-plan with the controller's fakes: the spec's bounds, the planner's choice (pure:
the layouts the checkpoint conversion reaches, `min_ranks`, the global batch, whole nodes),
and the controller's decisions: a job that lost a node waits `wait_s`, is re-planned onto the
node left and resumes there, with an event naming both layouts and their predicted step times;
with `scale_up` it moves back once the node returns (asked to save and stop, no retry spent);
a job without `elastic`, or one the conversion cannot move, keeps today's behaviour."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from service.cluster.data_plane import NodeCapacity, PollResult
from service.contract.spec import JobSpec, ParallelSpec
from service.contract.states import JobState
from service.control.controller import Controller
from service.policy.elastic_replan import ElasticState, conversion_refusal, reachable, replan
from service.store import AttemptStatus, Store
from service.submission.intake import submit as submit_job
from tests.conftest import tiny_spec
from tests.fakes import FakeNodesLauncher
from tests.fakes import job as make_job
from tests.waiting import drive

ELASTIC: dict[str, Any] = {"min_ranks": 1, "wait_s": 0}


def spec(**over: Any) -> JobSpec:
    base: dict[str, Any] = {"checkpoint": {"every_steps": 1}, "max_retries": 1,
                            "resources": {"gpus_per_worker": 0, "cpus_per_worker": 1}}
    return JobSpec.model_validate(tiny_spec(**(base | over)))


def placed(*nodes: str) -> PollResult:
    return PollResult(state="running", placement={
        "ranks": [{"rank": r, "node_id": n} for r, n in enumerate(nodes)]})


def runs(*nodes: str) -> list[PollResult]:
    return [placed(*nodes)] + [PollResult(state="running")] * 50


def lost() -> list[PollResult]:
    return [placed("n0", "n1"), PollResult(state="failed", error="rank 1: node died",
                                           failed_ranks=[1])]


def settle(c: Controller) -> None:
    assert c.teardowns.wait(30), "teardowns still running"


@pytest.mark.parametrize(("over", "field"), [
    ({"elastic": {"min_ranks": 3}}, "elastic.min_ranks"),
    ({"elastic": {"min_ranks": 0}}, "min_ranks"),
    ({"elastic": {"wait_s": -1}}, "wait_s"),
    ({"elastic": {"wait_s": 86401}}, "wait_s"),
    ({"elastic": {"scale_up": "yes"}}, "scale_up"),
    ({"elastic": {"later": 1}}, "later"),
    ({"elastic": {}, "checkpoint": {"every_steps": 0}}, "elastic"),
    ({"elastic": {}, "max_retries": 0}, "max_retries"),
])
def test_the_elastic_section_is_bounded_and_names_the_field(over: dict[str, Any],
                                                            field: str) -> None:
    with pytest.raises(ValidationError) as info:
        spec(**over)
    assert field in str(info.value), str(info.value)
    assert spec(elastic={}).elastic is not None and spec().elastic is None


def test_the_planner_chooses_among_the_layouts_the_conversion_reaches() -> None:
    job = make_job(1, world=2)
    s = spec(elastic=ELASTIC)
    state = ElasticState(submitted={"world_size": 2})
    got = replan(s, state, [NodeCapacity("n0", 1, 0)], min_ranks=1, exclude_world=2)
    assert not isinstance(got, str), got
    assert (got.world_size, got.plan.layout.dp, got.plan.chosen_by) == (1, 1, "elastic")
    # ZeRO 1 or 2 through the universal form; ZeRO 0 (fp32) through the layout-free one.
    assert got.plan.layout.zero in (0, 1, 2) and got.spec.train.global_batch == 8
    assert got.spec.layout.dp == 1 and got.plan.layout.micro_batch == got.spec.train.micro_batch
    assert job.world_size == 2
    # Not below min_ranks; not beyond the submitted world size however much room is free.
    assert "fewer than elastic.min_ranks(2)" in str(
        replan(s, state, [NodeCapacity("n0", 1, 0)], min_ranks=2))
    big = replan(s, state, [NodeCapacity("n0", 64, 0)], min_ranks=1)
    assert not isinstance(big, str) and big.world_size == 2
    # The same global batch: dp divides it (global 6 on room for 4: dp 3).
    six = spec(train={"steps": 6, "global_batch": 6, "micro_batch": 1, "precision": "fp32"},
               parallel={"dp": 6, "zero": 1}, elastic=ELASTIC)
    got = replan(six, ElasticState(submitted={"world_size": 6}), [NodeCapacity("n0", 4, 0)],
                 min_ranks=1)
    assert not isinstance(got, str) and got.world_size == 3
    # A cluster shrinks by whole nodes (or to part of one).
    nodes = spec(parallel={"dp": 8, "zero": 1}, train={"global_batch": 64, "micro_batch": 2},
                 cluster={"gpu": "a100-80gb", "nodes": 2, "gpus_per_node": 4},
                 resources={"gpus_per_worker": 1, "cpus_per_worker": 1}, elastic=ELASTIC)
    got = replan(nodes, ElasticState(submitted={"world_size": 8}),
                 [NodeCapacity("a", 8, 4), NodeCapacity("b", 8, 2)], min_ranks=2)
    assert not isinstance(got, str) and got.world_size == 4
    assert got.spec.cluster is not None and got.spec.cluster.nodes == 1


@pytest.mark.parametrize(("layout", "words"), [
    ({"pp": 2, "dp": 1, "virtual_stages": 2}, "interleaved"),
    ({"dp": 2, "zero": 0}, "ZeRO 0 in bf16")])
def test_layouts_the_conversion_cannot_move_are_refused_by_name(layout: dict[str, Any],
                                                                 words: str) -> None:
    refusal = conversion_refusal(ParallelSpec.model_validate(layout), "bf16")
    assert refusal is not None and words in refusal
    assert conversion_refusal(ParallelSpec(dp=4, zero=1), "bf16") is None
    assert conversion_refusal(ParallelSpec(dp=4, zero=0), "fp32") is None
    # TP, PP and ZeRO-3 move through the layout-free form (workers.checkpoint.layout_free).
    for moves in ({"tp": 2, "dp": 1, "zero": 1}, {"pp": 2, "dp": 1, "zero": 1},
                  {"dp": 2, "zero": 3}):
        assert conversion_refusal(ParallelSpec.model_validate(moves), "bf16") is None


def test_the_layout_free_form_reaches_other_splits_without_offload() -> None:
    z3 = reachable(ParallelSpec(dp=2, zero=3))
    assert z3(ParallelSpec(tp=2, dp=1, zero=1)) and z3(ParallelSpec(pp=2, dp=1, zero=1))
    assert not z3(ParallelSpec(pp=2, dp=1, zero=1, virtual_stages=2))
    assert not z3(ParallelSpec(dp=2, zero=3, offload="optimizer"))
    assert not reachable(ParallelSpec(tp=2, dp=1, zero=0), "bf16")(ParallelSpec(dp=2, zero=1))
    assert reachable(ParallelSpec(tp=2, dp=1, zero=0), "fp32")(ParallelSpec(dp=2, zero=0))


def test_zero_0_moves_within_zero_0() -> None:
    s = spec(parallel={"dp": 2, "zero": 0}, elastic=ELASTIC)
    got = replan(s, ElasticState(submitted={"world_size": 2}), [NodeCapacity("n0", 1, 0)],
                 min_ranks=1)
    assert not isinstance(got, str) and (got.world_size, got.spec.layout.zero) == (1, 0)


def controller(store: Store, launcher: FakeNodesLauncher, tmp_path: Path) -> Controller:
    return Controller(store, launcher, checkpoint_root=tmp_path, poll_timeout_s=0)


def lose_a_node(store: Store, tmp_path: Path, s: JobSpec,
                after: list[list[PollResult]]) -> tuple[int, FakeNodesLauncher, Controller]:
    """A two-rank job on n0 and n1 that loses n1: the passes up to its failure."""
    job_id = submit_job(store, s).id
    launcher = FakeNodesLauncher([lost(), *after], {"n0": 1, "n1": 1})
    c = controller(store, launcher, tmp_path)
    c.step()  # placed
    c.step()  # running
    launcher.nodes.pop("n1")
    c.step()  # failed: RESTARTING (a retry spent, as any failure)
    settle(c)
    return job_id, launcher, c


def test_a_job_that_lost_a_node_is_re_planned_onto_the_one_left_and_moves_back(
        store: Store, tmp_path: Path) -> None:
    job_id, launcher, c = lose_a_node(store, tmp_path, spec(
        elastic=ELASTIC | {"scale_up": True}), [runs("n0"), [placed("n0", "n1"),
                                                             PollResult(state="succeeded")]])
    submitted_plan = store.get_job(job_id=job_id).plan
    c.step()  # waits for room (none), wait_s 0 is over: re-planned, admitted, started
    job = store.get_job(job_id=job_id)
    assert job.state == JobState.PLACING and job.world_size == 1, store.list_events(job_id=job_id)
    assert launcher.started[1]["spec"].layout.dp == 1
    assert launcher.started[1]["plan"].chosen_by == "elastic"
    assert job.spec.train.global_batch == 8 and job.elastic is not None
    events = store.list_events(job_id=job_id)
    [queued] = [e for e in events if e.data.get("from") == "RESTARTING"]
    assert "waiting for room" in queued.message and "wait_s (0 s)" in queued.message
    [down] = [e for e in events if e.kind == "elastic"]
    assert down.data["direction"] == "down"
    assert down.data["from"]["layout"] == "tp1 pp1 dp2 zero2"
    assert down.data["from"]["predicted_step_s"] == submitted_plan.time.step_s
    assert down.data["to"]["world_size"] == 1 and down.data["to"]["predicted_step_s"] > 0
    assert "tp1 pp1 dp2 zero2 on 2 rank(s), predicted" in down.message, down.message

    c.step()  # running on n0
    assert store.get_job(job_id=job_id).state == JobState.RUNNING
    c.step()
    assert not launcher.groups[1].preempted  # no room yet
    launcher.nodes["n1"] = 1  # the node returns
    c.step()  # its room and n1 hold the submitted layout: asked to save and stop
    assert launcher.groups[1].preempted and job_id in c.rescaling.moving
    c.step()  # stopped: RESTARTING on the submitted layout, no retry spent
    settle(c)
    job = store.get_job(job_id=job_id)
    assert job.state == JobState.RESTARTING and job.world_size == 2 and job.moves_up == 1
    assert job.plan.to_json() == submitted_plan.to_json() and job.spec.layout.dp == 2
    drive(c, store, job_id, {JobState.SUCCEEDED, JobState.FAILED}, timeout=60)
    job = store.get_job(job_id=job_id)
    assert job.state == JobState.SUCCEEDED, store.list_events(job_id=job_id)
    assert [a.status for a in store.list_attempts(job_id=job_id)] == [
        AttemptStatus.FAILED, AttemptStatus.MOVED, AttemptStatus.SUCCEEDED]
    assert launcher.started[2]["spec"].layout.dp == 2
    up = [e for e in store.list_events(job_id=job_id) if e.kind == "elastic"][1:]
    assert [e.data["direction"] for e in up] == ["up", "up"]
    assert up[1].data["to"]["layout"] == "tp1 pp1 dp2 zero2"


@pytest.mark.parametrize("over", [{}, {"elastic": {"wait_s": 3600}}],
                         ids=["not-elastic", "before-wait_s"])
def test_without_elastic_or_before_wait_s_the_job_waits_for_its_room(
        store: Store, tmp_path: Path, over: dict[str, Any]) -> None:
    job_id, launcher, c = lose_a_node(store, tmp_path, spec(**over), [])
    for _ in range(3):
        c.step()
    job = store.get_job(job_id=job_id)
    assert job.state == JobState.QUEUED and job.world_size == 2 and job.elastic is None
    assert not [e for e in store.list_events(job_id=job_id) if e.kind == "elastic"]
    assert len(launcher.started) == 1


def test_a_job_the_conversion_cannot_move_says_so_once_and_waits(
        store: Store, tmp_path: Path) -> None:
    job_id, launcher, c = lose_a_node(store, tmp_path, spec(
        parallel={"pp": 2, "dp": 1, "virtual_stages": 2}, elastic=ELASTIC), [])
    for _ in range(3):
        c.step()
    job = store.get_job(job_id=job_id)
    assert job.state == JobState.QUEUED and job.world_size == 2
    [said] = [e for e in store.list_events(job_id=job_id) if e.kind == "elastic"]
    assert "not re-planned" in said.message and "interleaved" in said.message


def test_a_move_up_never_takes_the_room_a_queued_job_waits_for(
        store: Store, tmp_path: Path) -> None:
    job_id, launcher, c = lose_a_node(store, tmp_path, spec(
        elastic=ELASTIC | {"scale_up": True}), [runs("n0"), runs("n1")])
    c.step()
    c.step()
    assert store.get_job(job_id=job_id).world_size == 1
    # Another job needs two ranks: n1 back does not hold it, so it waits (admission's
    # blocked job), and the elastic job does not take n1 from under it.
    other = submit_job(store, spec(name="other")).id
    launcher.nodes["n1"] = 1
    for _ in range(3):
        c.step()
    assert not launcher.groups[1].preempted and job_id not in c.rescaling.moving
    assert store.get_job(job_id=other).state == JobState.QUEUED
