"""The store against SQLite and the real PostgreSQL server."""

from __future__ import annotations

import json
import threading

import pytest
from pydantic import ValidationError
from sqlalchemy import inspect, select, text, update

from service.contract.hardware import get_profile
from service.contract.spec import JobSpec, ParallelSpec
from service.contract.spec_limits import recheck
from service.contract.states import ALLOWED, JobState, TransitionError
from service.planner import StoredPlan, evaluate
from service.planner.memory import MemoryBreakdown, stage_memory
from service.planner.stored import plan_json
from service.planner.timing import TimeBreakdown
from service.store import AttemptStatus, NotFound, ProbeStatus, Store
from service.store.schema import downgrade, upgrade
from service.store.tables import JobRow
from tests.conftest import record_steps, stored_plan, tiny_spec


def _job(store: Store, **kw: object) -> int:
    args: dict = {"name": "j", "spec": JobSpec.model_validate(tiny_spec()),
                  "plan": stored_plan(dp=2),
                  "world_size": 2, "cpus": 1.0, "gpus": 0.0}
    args.update(kw)
    return store.create_job(**args).id


def test_create_writes_queued_and_an_event(store: Store) -> None:
    job_id = _job(store, priority=5)
    job = store.get_job(job_id=job_id)
    assert job.state == JobState.QUEUED and job.priority == 5 and job.owner == "local"
    assert [e.data["to"] for e in store.list_events(job_id=job_id)] == ["QUEUED"]


def test_the_job_create_returns_is_the_job_read_back(store: Store) -> None:
    """`create_job` answers with the job it wrote (no second read): equal to what any reader
    gets, its NULL columns NULL (not JSON's null), its secrets and tracker cursors written in
    the same transaction, the secrets' names in code point order on either database."""
    from service.store.tracking_exports import Exports, Sink

    made = store.create_job(
        name="j", spec=JobSpec.model_validate(tiny_spec()), plan=stored_plan(dp=2),
        world_size=2, cpus=1.0, gpus=0.0, priority=3, owner="alice", project="vision",
        idempotency_key="k", request_hash="h",
        secrets={"b_key": b"sealed-b", "B_KEY": b"sealed-B", "a": b"sealed-a"},
        tracking={"tensorboard": "/runs/j"})
    read = store.get_job(job_id=made.id)
    assert made == read and made.spec == read.spec and made.plan == read.plan
    assert (made.state, made.priority, made.owner, made.project) == (
        JobState.QUEUED, 3, "alice", "vision")
    assert made.created_at == read.created_at and made.created_at.tzinfo is not None
    with store.engine.connect() as c:
        nulls = c.execute(text("SELECT elastic IS NULL, waiting IS NULL, error IS NULL,"
                               " started_at IS NULL FROM jobs WHERE id = :i"),
                          {"i": made.id}).one()
    assert all(nulls), nulls
    assert store.job_secrets(job_id=made.id) == {
        "B_KEY": b"sealed-B", "a": b"sealed-a", "b_key": b"sealed-b"}
    assert store.secret_names(job_ids=[made.id]) == {made.id: ["B_KEY", "a", "b_key"]}
    [cursor] = Exports(store).of_job(job_id=made.id)
    assert (cursor.sink, cursor.target, cursor.step, cursor.done) == (
        Sink.TENSORBOARD, "/runs/j", 0, False)
    assert [e.message for e in store.list_events(job_id=made.id)] == ["job queued"]


def test_transition_checks_the_state_machine_and_records_the_event(store: Store) -> None:
    job_id = _job(store)
    store.transition(job_id=job_id, to=JobState.PLACING, message="admitted")
    with pytest.raises(TransitionError, match="cannot move a job from PLACING to SUCCEEDED"):
        store.transition(job_id=job_id, to=JobState.SUCCEEDED, message="nope")
    assert store.get_job(job_id=job_id).state == JobState.PLACING
    job = store.transition(job_id=job_id, to=JobState.RUNNING, message="running")
    assert job.started_at is not None and job.finished_at is None
    job = store.transition(job_id=job_id, to=JobState.FAILED, message="boom", error="trace")
    assert job.finished_at is not None and job.error == "trace"
    events = store.list_events(job_id=job_id)
    assert [(e.data.get("from"), e.data["to"]) for e in events] == [
        (None, "QUEUED"), ("QUEUED", "PLACING"), ("PLACING", "RUNNING"), ("RUNNING", "FAILED")]
    with pytest.raises(TransitionError):
        store.transition(job_id=job_id, to=JobState.RUNNING, message="again")


def test_plan_comes_back_typed_and_as_stored(store: Store) -> None:
    plan = stored_plan(tp=2, pp=2, dp=1)
    job = store.get_job(job_id=_job(store, plan=plan, world_size=4))
    assert job.plan.layout.parallel == ParallelSpec(tp=2, pp=2, dp=1)
    assert job.plan.world_size == 4 and job.plan.stage_of() == {0: 0, 1: 0, 2: 1, 3: 1}
    assert job.plan.rank_layout[3].layers == [(4, 8)] and job.plan.rank_layout[3].last_stage
    assert job.plan.time.step_s > 0 and job.plan.memory.total > job.plan.memory.model_states
    # Every key, typed or not, in the order it was stored.
    assert json.dumps(job.plan.to_json()) == json.dumps(plan.to_json())
    assert "explanation" in job.plan.to_json() and job.plan.chosen_by == "spec"


def test_a_stored_plan_holds_the_planners_own_breakdowns(store: Store) -> None:
    """The planner's TimeBreakdown and MemoryBreakdown are what is stored and read back; the
    per-stage memory and the MFU are typed too."""
    spec = JobSpec.model_validate(tiny_spec(
        model={"layers": 5, "hidden": 64, "heads": 8, "vocab": 256, "seq_len": 32},
        train={"global_batch": 4, "micro_batch": 1, "precision": "fp32"},
        parallel={"tp": 1, "pp": 2, "dp": 1}))
    planned = evaluate(spec)
    job = store.get_job(job_id=_job(store, plan=StoredPlan.from_json(plan_json(planned)),
                                    world_size=2))
    assert isinstance(job.plan.time, TimeBreakdown) and job.plan.time == planned.time
    assert isinstance(job.plan.memory, MemoryBreakdown) and job.plan.memory == planned.memory
    assert job.plan.mfu == pytest.approx(planned.mfu)
    by_stage = {s: stage_memory(planned.scenario, s) for s in range(2)}
    assert job.plan.stage_bytes() == {s: m.total for s, m in by_stage.items()}
    assert [m.layers for m in job.plan.memory_by_stage] == [[(0, 3)], [(3, 5)]]
    assert job.plan.stage_of() == {0: 0, 1: 1}
    # The stored JSON carries the breakdowns' derived keys, as the planner writes them, and
    # reads back as the very JSON the planner wrote, key for key and number for number.
    assert job.plan.to_json()["memory"] == planned.memory.to_json()
    assert json.dumps(job.plan.to_json()) == json.dumps(json.loads(json.dumps(
        plan_json(planned))))


def test_a_plan_stored_before_later_keys_reads_with_their_defaults() -> None:
    """Plans stored before `memory_by_stage`, `mfu`, the reserved bytes' split and the
    slowest stage existed still read, and dump back without them."""
    data = stored_plan(pp=2).to_json()
    del data["memory_by_stage"], data["mfu"]
    for key in ("cuda_context", "nccl_buffers", "framework", "allocator_slack"):
        del data["memory"][key]
    del data["time"]["slowest_stage"], data["time"]["stage_micro_batch_s"]
    plan = StoredPlan.from_json(data)
    assert plan.mfu is None and plan.memory_by_stage == [] and plan.stage_bytes() == {}
    assert plan.memory.cuda_context == 0.0 and plan.time.slowest_stage == 0
    assert plan.memory.total == pytest.approx(data["memory"]["total"])
    out = plan.to_json()
    assert "memory_by_stage" not in out and "mfu" not in out


def test_rank_rows_are_validated_on_first_use_only() -> None:
    """Reading a plan leaves its rank rows as stored (a pass over every active job reads
    every plan); a row is validated when it is first read, and the plan dumps back as is."""
    data = stored_plan(dp=2).to_json()
    data["rank_layout"] = [{"rank": 0, "layers": "not a row"}, {"rank": 1}]
    plan = StoredPlan.from_json(data)
    assert len(plan.rank_layout) == 2 and plan.layout.dp == 2
    assert plan.to_json()["rank_layout"] == data["rank_layout"]
    with pytest.raises(ValidationError, match="layers"):
        plan.rank_layout[0]
    good = stored_plan(tp=2, pp=2).rank_layout
    assert [r.rank for r in good] == [0, 1, 2, 3] and good[2].first_stage is False


def test_a_spec_stored_before_a_newer_limit_reads_and_is_rechecked(store: Store) -> None:
    """Ray's resource unit and the OS's path limits came after specs were first stored: a row
    that fails them reads as it was stored, and `recheck` (the controller's, before every
    attempt) names each field it fails."""
    spec = JobSpec.model_validate(tiny_spec()).model_dump(mode="json")
    spec["resources"]["cpus_per_worker"] = 1e-9
    spec["checkpoint"] = {**spec["checkpoint"], "every_steps": 2,
                          "dir": f"/ckpt/{'x' * 256}/line\nbreak"}
    with pytest.raises(ValidationError):
        JobSpec.model_validate(spec)  # what a submission of it is
    job_id = _job(store)
    with store.engine.begin() as c:
        c.execute(update(JobRow).where(JobRow.id == job_id).values(spec=spec))
    (listed,), _ = store.list_jobs()
    job = store.get_job(job_id=job_id)
    assert listed.spec == job.spec and job.spec.model_dump(mode="json") == spec
    with pytest.raises(ValidationError) as refused:
        recheck(job.spec)
    assert sorted(".".join(map(str, e["loc"])) for e in refused.value.errors()) == [
        "checkpoint.dir", "resources.cpus_per_worker"]


def test_expect_guards_against_races(store: Store) -> None:
    job_id = _job(store)
    with pytest.raises(TransitionError, match="expected one of RUNNING"):
        store.transition(job_id=job_id, to=JobState.CANCELLED, message="x",
                         expect=[JobState.RUNNING])
    assert store.get_job(job_id=job_id).state == JobState.QUEUED


def test_terminal_states_allow_nothing() -> None:
    for state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        assert state.terminal and not ALLOWED[state]


def test_cancel_of_queued_job_is_immediate_and_idempotent(store: Store) -> None:
    job_id = _job(store)
    assert store.request_cancel(job_id=job_id).state == JobState.CANCELLED
    with pytest.raises(TransitionError, match="already CANCELLED"):
        store.request_cancel(job_id=job_id)


def test_cancel_of_running_job_sets_the_flag(store: Store) -> None:
    job_id = _job(store)
    store.transition(job_id=job_id, to=JobState.PLACING, message="a")
    job = store.request_cancel(job_id=job_id)
    assert job.state == JobState.PLACING and job.cancel_requested
    assert store.request_cancel(job_id=job_id).cancel_requested  # twice is fine


def test_a_job_asked_to_cancel_is_not_moved_to_running(store: Store) -> None:
    job_id = _job(store)
    store.transition(job_id=job_id, to=JobState.PLACING, message="a")
    store.request_cancel(job_id=job_id)
    with pytest.raises(TransitionError, match="cancel requested"):
        store.transition(job_id=job_id, to=JobState.RUNNING, message="b", unless_cancelled=True)
    assert store.get_job(job_id=job_id).state == JobState.PLACING
    assert store.transition(job_id=job_id, to=JobState.CANCELLED, message="c",
                            unless_cancelled=False).state == JobState.CANCELLED


def test_queue_order_is_priority_then_age(store: Store) -> None:
    low, high, high2 = _job(store, priority=0), _job(store, priority=9), _job(store, priority=9)
    assert [j.id for j in store.queued_jobs()] == [high, high2, low]
    jobs, total = store.list_jobs(states=[JobState.QUEUED], limit=2)
    assert total == 3 and [j.id for j in jobs] == [high2, high]
    jobs, _ = store.list_jobs(limit=2, offset=2)
    assert [j.id for j in jobs] == [low]


def test_attempts_and_metrics(store: Store) -> None:
    job_id = _job(store)
    assert store.start_attempt(job_id=job_id).attempts == 1
    assert store.start_attempt(job_id=job_id).attempts == 2
    store.end_attempt(job_id=job_id, number=1, status=AttemptStatus.FAILED, error="x")
    record_steps(store, job_id=job_id, attempt=2, rows=[
        {"rank": r, "step": s, "loss": 5.0 - s, "step_time_s": 0.1, "tokens_per_s": 100.0,
         "data": {"memory": {"params": 10.0}}} for s in (1, 2, 3) for r in (0, 1)])
    rank0 = store.list_metrics(job_id=job_id)
    assert [(m.step, m.rank, m.loss) for m in rank0] == [(1, 0, 4.0), (2, 0, 3.0), (3, 0, 2.0)]
    assert rank0[0].data["memory"]["params"] == 10.0
    assert len(store.list_metrics(job_id=job_id, rank=None)) == 6
    assert [m.step for m in store.list_metrics(job_id=job_id, after_step=2)] == [3]
    latest = store.latest_metric(job_id=job_id)
    assert latest is not None and latest.step == 3
    attempts = store.list_attempts(job_id=job_id)
    assert [(a.number, a.status) for a in attempts] == [(1, AttemptStatus.FAILED),
                                                        (2, AttemptStatus.RUNNING)]
    assert attempts[0].error == "x" and attempts[0].ended_at is not None
    assert attempts[1].ended_at is None and attempts[1].started_at.tzinfo is not None


def test_missing_job(store: Store) -> None:
    with pytest.raises(NotFound):
        store.get_job(job_id=12345)
    with pytest.raises(NotFound):
        store.transition(job_id=12345, to=JobState.PLACING, message="x")


def test_concurrent_transitions_apply_exactly_once(store: Store) -> None:
    """Two controllers racing to admit the same job: one wins, the other is refused."""
    job_id = _job(store)
    outcomes: list[str] = []

    def admit() -> None:
        try:
            store.transition(job_id=job_id, to=JobState.PLACING, message="admit",
                             expect=[JobState.QUEUED])
            outcomes.append("ok")
        except TransitionError:
            outcomes.append("refused")

    threads = [threading.Thread(target=admit) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["ok", "refused", "refused", "refused"]
    placing = [e for e in store.list_events(job_id=job_id) if e.data.get("to") == "PLACING"]
    assert len(placing) == 1


def test_migrations_are_reversible(db_url: str) -> None:
    upgrade(db_url)
    s = Store(db_url)
    assert {"jobs", "attempts", "events", "metrics"} <= set(inspect(s.engine).get_table_names())
    downgrade(db_url)
    assert not {"jobs", "attempts", "events", "metrics"} & set(
        inspect(s.engine).get_table_names())
    upgrade(db_url)
    s.close()


def test_probes_are_claimed_once_and_finished(store: Store) -> None:
    p = store.create_probe(scope="cluster", request={"sizes": [1024]})
    assert p.status == ProbeStatus.PENDING
    assert [c.id for c in store.claim_probes(scope="cluster")] == [p.id]
    assert store.claim_probes(scope="cluster") == []
    assert store.get_probe(probe_id=p.id).status == ProbeStatus.RUNNING
    store.finish_probe(probe_id=p.id, status=ProbeStatus.DONE, results=[{"op": "all_reduce"}],
                       summary={"busbw": 1.5e9})
    done = store.get_probe(probe_id=p.id)
    assert done.status == ProbeStatus.DONE and done.results == [{"op": "all_reduce"}]
    assert done.finished_at is not None and done.summary == {"busbw": 1.5e9}
    assert [x.id for x in store.list_probes(scope="cluster")] == [p.id]
    with pytest.raises(NotFound):
        store.get_probe(probe_id=p.id + 1)


def test_nodes_are_upserted_and_dead_ones_kept(store: Store) -> None:
    store.upsert_nodes(nodes=[{"node_id": "a", "hostname": "h1", "gpus": 0},
                              {"node_id": "b", "hostname": "h2", "gpus": 8}])
    store.upsert_nodes(nodes=[{"node_id": "b", "hostname": "h2", "gpus": 4}])
    nodes = {n.node_id: n for n in store.list_nodes()}
    assert not nodes["a"].alive and nodes["b"].alive and nodes["b"].info["gpus"] == 4
    assert nodes["b"].hostname == "h2" and nodes["b"].updated_at.tzinfo is not None


def test_calibrated_profiles_replace_older_ones(store: Store) -> None:
    assert store.get_profile(name="cpu") is None
    cpu = get_profile("cpu")
    store.save_profile(name="cpu", profile=cpu.with_(peak_flops_fp32=1e10).to_json())
    store.save_profile(name="cpu", profile={**cpu.with_(peak_flops_fp32=2e10).to_json(),
                                            "retired_field": 1}, probe_id=None)
    calibrated = store.get_profile(name="cpu")
    assert calibrated is not None and calibrated.profile == cpu.with_(peak_flops_fp32=2e10)
    assert calibrated.probe_id is None and calibrated.calibrated_at.tzinfo is not None


def test_migration_resolves_auto_specs_stored_before(db_url: str) -> None:
    upgrade(db_url, "0002")
    plan = stored_plan(dp=2).to_json()
    spec = {"name": "j", "model": {"preset": "gpt-tiny"}, "parallel": "auto",
            "train": {"micro_batch": 7, "steps": 3},
            "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 2}}
    s = Store(db_url)
    with s.engine.begin() as c:
        c.execute(text("INSERT INTO jobs (name, owner, state, priority, spec, plan, world_size,"
                       " cpus, gpus, cancel_requested, attempts, created_at, updated_at)"
                       " VALUES ('j', 'local', 'QUEUED', 0, :spec, :plan, 2, 1, 0, false, 0,"
                       " CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
                  {"spec": json.dumps(spec), "plan": json.dumps(plan)})
    upgrade(db_url)
    with s.engine.begin() as c:
        stored = c.execute(select(JobRow.spec)).scalar_one()
    layout = dict(plan["layout"])
    micro_batch = layout.pop("micro_batch")
    assert stored["train"] == {"micro_batch": micro_batch, "steps": 3}
    assert stored["parallel"] == layout
    (job,), _ = s.list_jobs()  # and it reads as the spec that runs
    assert job.spec.train.micro_batch == micro_batch and job.spec.train.steps == 3
    assert job.spec.layout == ParallelSpec.model_validate(layout)
    s.close()


def test_migration_makes_env_values_stored_before_printable(db_url: str) -> None:
    """A spec stored before env values had to be printable text reads as a JobSpec after the
    upgrade: its control characters are written as escapes, and the job says so."""
    upgrade(db_url, "0011")
    spec = JobSpec.model_validate(tiny_spec()).model_dump(mode="json")
    spec["env"] = {"BANNER": "one\ntwo\tthree\x00", "PLAIN": "as it was"}
    with pytest.raises(ValidationError, match="control character"):
        JobSpec.model_validate(spec)  # what the row could not be read as
    s = Store(db_url)
    with s.engine.begin() as c:
        c.execute(text("INSERT INTO jobs (name, owner, state, priority, spec, plan, world_size,"
                       " cpus, gpus, cancel_requested, attempts, created_at, updated_at)"
                       " VALUES ('old', 'local', 'QUEUED', 0, :spec, :plan, 2, 1, 0, false, 0,"
                       " CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
                  {"spec": json.dumps(spec), "plan": json.dumps(stored_plan(dp=2).to_json())})
    upgrade(db_url)
    (job,), _ = s.list_jobs()
    assert job.spec.env == {"BANNER": "one\\ntwo\\tthree\\x00", "PLAIN": "as it was"}
    assert job.spec.model_dump(mode="json") == {**spec, "env": job.spec.env}
    (event,) = [e for e in s.list_events(job_id=job.id) if e.kind == "spec"]
    assert event.data == {"escaped": ["BANNER"]} and "BANNER" in event.message
    s.close()


def test_idempotency_keys_are_unique_per_owner_and_find_their_job(store: Store) -> None:
    from service.store import KeyTaken

    job_id = _job(store, owner="alice", idempotency_key="k1", request_hash="h1")
    _job(store, owner="alice")  # jobs without a key never collide
    _job(store, owner="alice")
    found = store.job_by_idempotency_key(owner="alice", key="k1")
    assert found is not None and found[0].id == job_id and found[1] == "h1"
    assert store.job_by_idempotency_key(owner="alice", key="k2") is None
    with pytest.raises(KeyTaken) as taken:
        _job(store, owner="alice", idempotency_key="k1", request_hash="h2")
    assert taken.value.job.id == job_id and taken.value.request_hash == "h1"
    # Another owner's key is not found, and the same key makes a job of that owner's.
    assert store.job_by_idempotency_key(owner="bob", key="k1") is None
    bobs = _job(store, owner="bob", idempotency_key="k1", request_hash="h2")
    assert bobs != job_id
    found = store.job_by_idempotency_key(owner="bob", key="k1")
    assert found is not None and found[0].id == bobs and found[0].owner == "bob"
    found = store.job_by_idempotency_key(owner="alice", key="k1")
    assert found is not None and found[0].id == job_id
    assert store.list_jobs()[1] == 4


def test_idempotency_key_per_owner_revision_both_ways(db_url: str) -> None:
    """0011 scopes keys to their owner; its downgrade keeps every job and gives a key that
    two owners share back to the oldest of their jobs only."""
    from sqlalchemy.exc import IntegrityError

    upgrade(db_url, "0010")
    s = Store(db_url)
    with s.engine.begin() as c:
        c.execute(text("INSERT INTO jobs (name, owner, state, priority, spec, plan, world_size,"
                       " cpus, gpus, cancel_requested, attempts, created_at, updated_at,"
                       " idempotency_key) VALUES ('old', 'alice', 'QUEUED', 0, :spec, :plan,"
                       " 2, 1, 0, false, 0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 'k')"),
                  {"plan": json.dumps(stored_plan(dp=2).to_json()),
                   "spec": json.dumps(JobSpec.model_validate(tiny_spec()).model_dump(
                       mode="json"))})
    upgrade(db_url)
    indexes = {i["name"]: i for i in inspect(s.engine).get_indexes("jobs")}
    assert "ix_jobs_idempotency_key" not in indexes
    scoped = indexes["ix_jobs_owner_idempotency_key"]
    assert scoped["column_names"] == ["owner", "idempotency_key"] and scoped["unique"]
    (old,), _ = s.list_jobs()
    found = s.job_by_idempotency_key(owner="alice", key="k")
    assert found is not None and found[0].id == old.id  # the key stored before still works
    bobs = _job(s, owner="bob", idempotency_key="k")
    others = _job(s, owner="bob", idempotency_key="other")
    downgrade(db_url, "0010")
    with s.engine.begin() as c:
        keys = dict(c.execute(text("SELECT id, idempotency_key FROM jobs")).all())
        assert c.execute(text("SELECT count(*) FROM events")).scalar_one() == 2
    assert keys == {old.id: "k", bobs: None, others: "other"}
    with pytest.raises(IntegrityError), s.engine.begin() as c:  # unique over all users again
        c.execute(text("UPDATE jobs SET idempotency_key = 'k' WHERE id = :i"), {"i": bobs})
    upgrade(db_url)
    assert _job(s, owner="carol", idempotency_key="k") not in keys
    s.close()


def test_idempotency_key_revision_keeps_jobs_both_ways(db_url: str) -> None:
    upgrade(db_url, "0003")
    s = Store(db_url)
    with s.engine.begin() as c:
        c.execute(text("INSERT INTO jobs (name, owner, state, priority, spec, plan, world_size,"
                       " cpus, gpus, cancel_requested, attempts, created_at, updated_at)"
                       " VALUES ('old', 'local', 'QUEUED', 0, :spec, :plan, 2, 1, 0, false, 0,"
                       " CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
                  {"plan": json.dumps(stored_plan(dp=2).to_json()),
                   "spec": json.dumps(JobSpec.model_validate(tiny_spec()).model_dump(
                       mode="json"))})
        old_id = c.execute(text("SELECT id FROM jobs")).scalar_one()
        c.execute(text("INSERT INTO events (job_id, kind, message, data, time) VALUES"
                       " (:j, 'state', 'job queued', '{}', CURRENT_TIMESTAMP)"), {"j": old_id})
    upgrade(db_url)
    columns = {c["name"] for c in inspect(s.engine).get_columns("jobs")}
    assert {"idempotency_key", "request_hash"} <= columns
    (job,), _ = s.list_jobs()
    assert job.name == "old" and store_has_key(s, old_id) is None
    _job(s, idempotency_key="k")
    downgrade(db_url, "0003")
    columns = {c["name"] for c in inspect(s.engine).get_columns("jobs")}
    assert not {"idempotency_key", "request_hash"} & columns
    with s.engine.begin() as c:  # nothing cascaded away
        assert c.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 2
        assert c.execute(text("SELECT count(*) FROM events")).scalar_one() == 2
    upgrade(db_url)
    s.close()


def store_has_key(s: Store, job_id: int) -> str | None:
    with s.engine.begin() as c:
        return c.execute(text("SELECT idempotency_key FROM jobs WHERE id = :i"),
                         {"i": job_id}).scalar_one()
