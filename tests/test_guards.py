"""The training guards on real DeepSpeed ranks (2 CPU ranks, gloo, the tiny model): a NaN
step is skipped on every rank with the parameters and Adam states unchanged, a run of them
rolls back to the checkpoint and never reads their samples again, a spike under `on_spike:
stop` fails the run with the reason (`workers.trainer.guard`, `docs/guards.md`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from service.cluster.data_plane import PollResult
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.control.worker_reports import store_poll
from service.settings import Settings
from service.store import Store
from service.store.metrics import MetricsIngest
from service.submission.intake import submit
from tests.conftest import authed_client
from tests.workers_spawn import run_ranks


def guarded_spec(steps: int, faults: list[dict], every: int = 0,
                 parallel: dict | None = None, **guard) -> JobSpec:
    return JobSpec(name="guards", model={"preset": "gpt-tiny"},
                   parallel=parallel or {"dp": 2, "zero": 1},
                   train={"steps": steps, "global_batch": 8, "micro_batch": 2,
                          "guard": guard},
                   checkpoint={"every_steps": every} if every else {}, faults=faults)


def rank0(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if r["rank"] == 0}


def _states(tag: Path) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], list[int]]:
    """Rank 0's parameters, fp32 master partition and Adam states (tensors, step counts) in
    a DeepSpeed ZeRO-1 tag."""
    model = torch.load(next(tag.glob("mp_rank_*_model_states.pt")), weights_only=False)
    optim = torch.load(next(tag.glob("*zero_pp_rank_0_*optim_states.pt")),
                       weights_only=False)["optimizer_state_dict"]
    adam = optim["base_optimizer_state"]["state"]
    tensors = [t for s in adam.values() for k, t in sorted(s.items()) if k != "step"]
    return (model["module"], [*optim["single_partition_of_fp32_groups"], *tensors],
            [int(s["step"]) for s in adam.values()])


@pytest.mark.slow
@pytest.mark.parametrize("kind,guard,why", [
    ("nan", {}, "loss not finite"),
    # A finite loss: DeepSpeed sees nothing wrong, the guard's gate alone skips the update.
    ("spike", {"window": 2}, "loss spike: "),
])
def test_a_bad_step_is_skipped_on_every_rank_and_changes_nothing(
        tmp_path: Path, kind: str, guard: dict, why: str) -> None:
    spec = guarded_spec(4, [{"kind": kind, "rank": 1, "step": 3}], every=1, **guard)
    rows = run_ranks(spec, checkpoint_dir=str(tmp_path))[0]
    for rank in (0, 1):
        mine = {r["step"]: r for r in rows if r["rank"] == rank}
        assert [mine[s].get("skipped") for s in range(1, 5)] == [None, None, True, None]
        assert mine[3]["guard"].startswith(why) and mine[4]["skipped_steps"] == 1
    assert rank0(rows)[4]["loss"] is not None
    before, after, last = (_states(tmp_path / name) for name in ("step2", "step3", "step4"))
    # The skipped step's tag holds the weights, masters and Adam states of the step before.
    for key, value in before[0].items():
        assert torch.equal(value, after[0][key]), key
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))
    assert before[2] == after[2] == [2] * len(before[2])
    # One optimizer update fewer than steps: Adam counted 3 updates in 4 steps.
    assert last[2] == [3] * len(last[2])
    assert not all(torch.equal(a, b) for a, b in zip(after[1], last[1], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"pp": 2}, {"pp": 2, "virtual_stages": 2}])
def test_a_pipeline_skips_a_nan_step_by_its_gradient_norm(parallel: dict) -> None:
    # The loss comes with the update inside train_batch: the NaN reaches the gradient, whose
    # global norm (over both stages) stops the update on both ranks.
    spec = guarded_spec(3, [{"kind": "nan", "rank": 1, "step": 2}], parallel=parallel)
    rows = run_ranks(spec)[0]
    for rank in (0, 1):
        mine = {r["step"]: r for r in rows if r["rank"] == rank}
        assert [mine[s].get("skipped") for s in (1, 2, 3)] == [None, True, None]
        assert mine[2]["guard"] == "gradient norm not finite"
        assert mine[3]["loss"] is not None and mine[3]["skipped_steps"] == 1


@pytest.mark.slow
def test_a_run_of_nan_steps_rolls_back_and_never_reads_their_samples_again(
        sqlite_store: Store, tmp_path: Path) -> None:
    faults = [{"kind": "nan", "rank": 1, "step": s} for s in (4, 5, 6)]
    spec = guarded_spec(8, faults, every=2, max_skips=2)
    rows = run_ranks(spec, checkpoint_dir=str(tmp_path / "ckpt"))[0]
    steps = rank0(rows)
    assert [s for s, r in steps.items() if r.get("skipped")] == [4, 5, 6]
    rollback = steps[6]["rollback"]
    assert rollback["to_step"] == 4  # the newest tag (step 4's: the weights of step 3)
    skipped = [(first, end) for first, end in rollback["samples"]]
    assert skipped == [(steps[s]["first_sample"], steps[s]["first_sample"] + 8)
                       for s in (4, 5, 6)]
    after = [(steps[s]["first_sample"], steps[s]["first_sample"] + steps[s]["batch"])
             for s in (7, 8)]
    # Back at the checkpoint's 32 samples, the loader passes over [32, 48): step 5's and 6's
    # batches (step 4's, [24, 32), came before the checkpoint's position).
    assert after == [(48, 56), (56, 64)]
    assert not any(a < e and f < b for a, b in after for f, e in skipped)
    assert steps[8]["loss"] is not None and not steps[8].get("skipped")
    assert steps[8]["skipped_steps"] == 3 and steps[8]["rollbacks"] == 1

    # What the controller stores of those reports: an event per skip and for the rollback,
    # and the job's counter on /metrics says as many.
    job_id = submit(sqlite_store, spec).id
    for to in (JobState.PLACING, JobState.RUNNING):
        sqlite_store.transition(job_id=job_id, to=to, message=to.value)
    sqlite_store.start_attempt(job_id=job_id)
    store_poll(sqlite_store, MetricsIngest(sqlite_store), job_id=job_id, attempt=1,
               world_size=2, poll=PollResult(state="running", reports=rows), health=None)
    events = sqlite_store.list_events(job_id=job_id)
    kinds = [e.kind for e in events if e.kind.startswith("guard_")]
    assert kinds == ["guard_skip"] * 3 + ["guard_rollback"]
    assert "rolled back to the checkpoint of step 4" in events[-1].message
    with authed_client(create_app(Settings(data_dir=tmp_path), store=sqlite_store),
                       sqlite_store) as client:
        text = client.get("/metrics").text
        marks = client.get(f"/api/v1/jobs/{job_id}/series").json()["guard"]
    # The loss chart's marks are those events, at their steps.
    assert [(m["step"], m["kind"]) for m in marks] == [
        (4, "guard_skip"), (5, "guard_skip"), (6, "guard_skip"), (6, "guard_rollback")]
    counted = {s.labels["kind"]: s.value for f in text_string_to_metric_families(text)
               if f.name == "trident_job_guard_events" for s in f.samples
               if s.labels["job_id"] == str(job_id)}
    assert counted == {kind: kinds.count(kind) for kind in
                       ("guard_skip", "guard_spike", "guard_rollback")}


@pytest.mark.slow
def test_a_spike_with_on_spike_stop_fails_the_run_with_the_reason() -> None:
    spec = guarded_spec(8, [{"kind": "spike", "rank": 0, "step": 7, "factor": 100.0}],
                        on_spike="stop")
    with pytest.raises(RuntimeError, match="training guard stopped the job: loss spike"):
        run_ranks(spec)
