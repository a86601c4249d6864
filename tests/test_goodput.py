"""The goodput ledger's arithmetic on a real store (SQLite and PostgreSQL): a job's history
written as the controller writes it (state changes, attempts, a placement event, step reports
with their ends, evaluations and saves), its ledger read back. The step ends are given, so the
expected seconds are known exactly; the state changes happen at the store's own times, which
the ledger is read against."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from cli.goodput import summary_text
from client.ledger import CATEGORIES, GoodputSummary, ProfilePrice
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.store import AttemptStatus, Store
from service.store.goodput import GoodputLedger, clip, totals
from service.submission.intake import submit
from tests.conftest import record_steps, tiny_spec


def step(rank: int, n: int, ended: float, **data: float) -> dict:
    return {"rank": rank, "step": n, "loss": 1.0, "step_time_s": 0.04, "tokens_per_s": 1.0,
            "lr": 0.001, "grad_norm": 1.0, "data": {"ended_at": ended, **data}}


def run_steps(store: Store, job_id: int, attempt: int, steps: range, base: float,
              resumed: int, **extra: dict[str, float]) -> dict[int, float]:
    """Steps `steps` on two ranks, 0.05 s apart from `base` (rank 1 ends 0.01 s after rank 0):
    their ends, by step."""
    ends = {}
    for i, n in enumerate(steps):
        ended = base + 0.05 * (i + 1)
        ends[n] = ended + 0.01
        more = {"resumed_from": resumed, **extra.get(str(n), {})}
        record_steps(store, job_id=job_id, attempt=attempt,
                     rows=[step(0, n, ended, **more), step(1, n, ended + 0.01, **more)])
    return ends


def begin(store: Store, job_id: int) -> int:
    job = store.start_attempt(job_id=job_id)
    store.transition(job_id=job_id, to=JobState.PLACING, message="admitted",
                     attempt=job.attempts)
    time.sleep(0.05)
    store.add_event(job_id=job_id, attempt=job.attempts, kind="placement", message="placed")
    time.sleep(0.05)
    store.transition(job_id=job_id, to=JobState.RUNNING, message="running",
                     attempt=job.attempts)
    return job.attempts


def test_a_restarted_job_loses_the_steps_past_the_checkpoint_and_tiles_its_wall_time(
        store: Store) -> None:
    job = submit(store, JobSpec.model_validate(tiny_spec(checkpoint={"every_steps": 2})))
    time.sleep(0.05)
    one = begin(store, job.id)
    base = time.time() + 0.1  # the steps start after the ranks' start-up
    # Step 2 is the checkpoint (its save 0.02 s); step 3 evaluated (0.01 s); then a failure.
    ends = run_steps(store, job.id, one, range(1, 6), base, 0,
                     **{"2": {"save_s": 0.02}, "3": {"eval_s": 0.01}})
    time.sleep(max(0.0, ends[5] - time.time()) + 0.1)
    store.end_attempt(job_id=job.id, number=one, status=AttemptStatus.FAILED, error="boom")
    store.transition(job_id=job.id, to=JobState.RESTARTING, message="failed", attempt=one,
                     data={"error": "boom"})
    time.sleep(0.05)
    two = begin(store, job.id)
    base2 = time.time() + 0.1
    ends2 = run_steps(store, job.id, two, range(3, 7), base2, 2, **{"3": {"load_s": 0.03}})
    time.sleep(max(0.0, ends2[6] - time.time()) + 0.05)
    store.end_attempt(job_id=job.id, number=two, status=AttemptStatus.SUCCEEDED)
    store.transition(job_id=job.id, to=JobState.SUCCEEDED, message="done", attempt=two)

    ledger = GoodputLedger(store).ledger(job.id)
    ended = store.get_job(job_id=job.id)
    assert ended.finished_at is not None
    assert ledger.wall_s == pytest.approx((ended.finished_at - ended.created_at).total_seconds(),
                                          abs=1e-5)
    assert [c.category for c in ledger.categories] == list(CATEGORIES)
    assert sum(c.seconds for c in ledger.categories) == pytest.approx(ledger.wall_s, abs=1e-5)
    # Steps 3 to 5 of the first attempt were redone: from step 2's end to step 5's, less the
    # save of step 2 and the evaluation of step 3 that fell in it.
    assert ledger.total("lost").seconds == pytest.approx(ends[5] - ends[2] - 0.02 - 0.01,
                                                         abs=1e-5)
    assert (ledger.steps_counted, ledger.steps_lost) == (6, 3)
    # Training: the first attempt's first two steps (from step 1's start, its end less its
    # slowest rank's step time), the second attempt's four.
    first = ends[2] - (ends[1] - 0.04)
    second = ends2[6] - (ends2[3] - 0.04)
    assert ledger.total("training").seconds == pytest.approx(first + second, abs=1e-5)
    assert ledger.total("checkpoint_save").seconds == pytest.approx(0.02, abs=1e-5)
    assert ledger.total("evaluation").seconds == pytest.approx(0.01, abs=1e-5)
    assert ledger.total("checkpoint_load").seconds == pytest.approx(0.03, abs=1e-5)
    assert ledger.total("recovery").seconds > 0.1  # the failure's tail and the restart
    events = store.list_events(job_id=job.id, limit=100)
    placing = [e.time for e in events if e.kind == "state" and e.data["to"] == "PLACING"]
    placed = [e.time for e in events if e.kind == "placement"]
    assert ledger.total("placement").seconds == pytest.approx(
        sum((b - a).total_seconds() for a, b in zip(placing, placed, strict=True)), abs=1e-5)
    assert ledger.ettr == pytest.approx(ledger.total("training").seconds / ledger.wall_s)
    assert ledger.tokens == 6 * 8 * job.spec.model.seq_len  # 6 steps of 8 samples
    # Two ranks held through every attempt; nothing while queued.
    for c in ledger.categories:
        held = 0 if c.category == "queued" else 2
        assert c.rank_seconds == pytest.approx(held * c.seconds, rel=1e-6)
        assert c.cpu_seconds == pytest.approx(c.rank_seconds * 0.5, rel=1e-6)
        assert c.gpu_seconds == 0 and c.cost is None
    segs = ledger.segments
    assert segs[0].start == ledger.start and segs[-1].end == ledger.end
    assert all(a.end == b.start for a, b in zip(segs, segs[1:], strict=False))


def four_steps(store: Store) -> int:
    """A job of 4 steps on 2 ranks of 0.5 CPU, succeeded: its id."""
    job = submit(store, JobSpec.model_validate(tiny_spec()))
    one = begin(store, job.id)
    ends = run_steps(store, job.id, one, range(1, 5), time.time() + 0.05, 0)
    time.sleep(max(0.0, ends[4] - time.time()) + 0.05)
    store.end_attempt(job_id=job.id, number=one, status=AttemptStatus.SUCCEEDED)
    store.transition(job_id=job.id, to=JobState.SUCCEEDED, message="done", attempt=one)
    return job.id


def test_prices_turn_held_seconds_into_money_and_a_window_clips_the_ledger(
        store: Store) -> None:
    job = store.get_job(job_id=four_steps(store))
    priced = GoodputLedger(store, {"cpu": ProfilePrice(cpu_hour=3600.0)}).ledger(job.id)
    # 2 ranks of 0.5 CPU at 1 a CPU-second.
    held = sum(c.cpu_seconds for c in priced.categories)
    assert priced.cost == pytest.approx(held, rel=1e-6)
    assert priced.cost_per_billion_tokens == pytest.approx(held / priced.tokens * 1e9)
    assert GoodputLedger(store).ledger(job.id).cost is None  # no price, no money
    half = priced.start + (priced.end - priced.start) / 2
    early = clip(priced, None, half)
    late = clip(priced, half, None)
    assert early.wall_s + late.wall_s == pytest.approx(priced.wall_s, abs=1e-5)
    for c in CATEGORIES:
        assert early.total(c).seconds + late.total(c).seconds == pytest.approx(
            priced.total(c).seconds, abs=1e-5)
    both = totals("all", [early, late])
    assert both.wall_s == pytest.approx(priced.wall_s, abs=1e-5)
    assert both.ettr == pytest.approx(priced.ettr, rel=1e-4)
    summary = GoodputLedger(store).summary(since=half - timedelta(hours=1))
    assert summary.cluster.jobs == 1 and summary.projects[0].key == (job.project or "")


def test_a_group_costs_per_billion_tokens_only_the_jobs_of_known_tokens_and_price(
        store: Store) -> None:
    # Three jobs: one priced with its tokens, one whose tokens nobody measured (a command
    # job without a model) that held three times the money, one of known tokens and no
    # price. The group's tokens are the known ones; its cost is every priced job's; per
    # billion tokens counts only the first job's money and tokens (every priced job's money
    # over every known token, as before, was twice that).
    a, b = four_steps(store), four_steps(store)
    ledger = GoodputLedger(store, {"cpu": ProfilePrice(cpu_hour=3600.0)}).ledger(a)
    assert ledger.cost and ledger.tokens
    unknown = GoodputLedger(store, {"cpu": ProfilePrice(cpu_hour=3600.0)}).ledger(b) \
        .model_copy(update={"tokens": None, "cost": 3 * ledger.cost})
    unpriced = GoodputLedger(store).ledger(a)
    assert unpriced.cost is None and unpriced.tokens == ledger.tokens
    group = totals("project", [ledger, unknown, unpriced])
    assert (group.jobs, group.jobs_tokens_unknown) == (3, 1)
    assert group.tokens == 2 * ledger.tokens
    assert group.cost == pytest.approx(4 * ledger.cost)
    assert group.cost_per_billion_tokens == pytest.approx(ledger.cost / ledger.tokens * 1e9)
    none_known = totals("project", [unknown])
    assert none_known.tokens == 0 and none_known.cost_per_billion_tokens is None
    text = summary_text(GoodputSummary(until=ledger.end, cluster=group))
    row = next(line for line in text.splitlines() if line.startswith("cluster"))
    assert f"{2 * ledger.tokens:,} (+1 not known)" in row, text
