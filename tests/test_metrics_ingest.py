"""The metrics path for large jobs (`service.store.metrics`), on SQLite and PostgreSQL: a
job-level row per step merged over polls and repeats, per-rank rows kept for small jobs in full
and for large ones sampled plus stragglers, retention, and the job page's newest steps."""

from __future__ import annotations

import pytest

from service.contract.spec import JobSpec
from service.store import Store
from service.store import metrics as mi
from service.store.metrics import MetricsIngest
from tests.conftest import stored_plan, tiny_spec


def _job(store: Store, world: int) -> int:
    return store.create_job(name="big", spec=JobSpec.model_validate(tiny_spec()),
                            plan=stored_plan(), world_size=world,
                            cpus=1, gpus=0).id


def _rows(step: int, ranks: range, slow: dict[int, float] | None = None) -> list[dict]:
    slow = slow or {}
    return [{"rank": r, "step": step, "loss": 2.0 + step, "step_time_s": slow.get(r, 1.0),
             "tokens_per_s": 1000.0 / slow.get(r, 1.0), "lr": 1e-3 / step,
             "grad_norm": 0.5 * step, "data": {"memory": {}}} for r in ranks]


def test_large_job_keeps_a_step_row_and_samples_ranks(store: Store) -> None:
    world = 4096
    job = _job(store, world)
    ing = MetricsIngest(store)
    # Step 1 arrives in two polls, the second with two stragglers (ranks 2777, 3000) and
    # ten repeats (1990-1999), merged once.
    kept1 = ing.record(job_id=job, attempt=1, world_size=world, rows=_rows(1, range(0, 2000)))
    kept2 = ing.record(job_id=job, attempt=1, world_size=world,
                       rows=_rows(1, range(1990, world), slow={2777: 9.0, 3000: 1.5}))
    stride = mi.sample_stride(world)
    assert stride == world // mi.SAMPLED_RANKS
    [step] = ing.list_steps(job_id=job)
    assert (step.step, step.ranks, step.world_size, step.complete) == (1, world, world, True)
    assert step.worst_rank == 2777 and step.step_time_max == 9.0
    assert step.step_time_min == 1.0
    assert step.step_time_mean == pytest.approx((world - 2 + 9.0 + 1.5) / world)
    assert step.stragglers == 2
    assert step.tokens_per_s == pytest.approx(1000.0 / 9.0)
    assert step.loss == 3.0
    assert (step.lr, step.grad_norm) == (1e-3, 0.5)  # the step's, once for all ranks
    stored = {m.rank for m in store.list_metrics(job_id=job, rank=None)}
    assert 0 in stored and 2777 in stored and 3000 in stored
    assert {r for r in range(world) if r % stride == 0} <= stored
    assert len(stored) == world // stride + 2
    assert kept1 + kept2 >= len(stored)
    # A poll that repeats the whole step (acknowledgements lost) changes nothing.
    ing.record(job_id=job, attempt=1, world_size=world, rows=_rows(1, range(world)))
    assert ing.list_steps(job_id=job) == [step]
    assert {m.rank for m in store.list_metrics(job_id=job, rank=None)} == stored


def test_small_job_keeps_every_rank(store: Store) -> None:
    job = _job(store, 8)
    ing = MetricsIngest(store)
    assert ing.record(job_id=job, attempt=1, world_size=8, rows=_rows(1, range(8))) == 8
    ing.record(job_id=job, attempt=1, world_size=8, rows=_rows(2, range(4)))
    assert len(store.list_metrics(job_id=job, rank=None)) == 12
    steps = ing.list_steps(job_id=job)
    assert [(s.step, s.ranks, s.complete) for s in steps] == [(1, 8, True), (2, 4, False)]
    ing.record(job_id=job, attempt=1, world_size=8, rows=_rows(2, range(2, 8)))
    assert ing.list_steps(job_id=job)[1].ranks == 8
    assert store.latest_metric(job_id=job).step == 2  # existing callers still work
    assert (store.latest_metric(job_id=job).lr, store.latest_metric(job_id=job).grad_norm) == (
        5e-4, 1.0)


def test_retention_and_downsampled_reads(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mi, "RETAIN_STEPS", 20)
    monkeypatch.setattr(mi, "KEEP_EVERY", 5)
    monkeypatch.setattr(mi, "COMPACT_EVERY", 10)
    job = _job(store, 4)
    ing = MetricsIngest(store)
    for step in range(1, 31):
        ing.record(job_id=job, attempt=1, world_size=4, rows=_rows(step, range(4)))
    # At step 30 (a multiple of 10, past 20), steps before 10 lost ranks 1-3 except 5.
    by_step: dict[int, set[int]] = {}
    for m in store.list_metrics(job_id=job, rank=None):
        by_step.setdefault(m.step, set()).add(m.rank)
    assert by_step[3] == {0} and by_step[5] == {0, 1, 2, 3} and by_step[10] == {0, 1, 2, 3}
    assert len(ing.list_steps(job_id=job)) == 30
    assert [s.step for s in ing.list_steps(job_id=job, every=10)] == [10, 20, 30]
    recent = ing.recent_metrics(job_id=job, limit=4)
    assert [m.step for m in recent] == [27, 28, 29, 30]
    ing.record(job_id=job, attempt=2, world_size=4, rows=_rows(1, range(4)))
    assert [(m.attempt, m.step) for m in ing.recent_metrics(job_id=job)] == [(2, 1)]
