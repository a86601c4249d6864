"""A stored step read back typed (`service.store.steps`, `Metric.report`): a step report as
the controller stores it (`StepReport.row()` through `MetricsIngest`), on SQLite and
PostgreSQL, comes back with its collectives, memory, bubble and custom metrics typed, and
`step_split()` adds its seconds per dimension and its compute."""

from __future__ import annotations

import pytest

from service.contract.reports import MemoryReport, StepReport
from service.contract.spec import JobSpec
from service.store import Store
from service.store.metrics import MetricsIngest
from tests.conftest import stored_plan, tiny_spec


def _op(time_s: float, nbytes: float, calls: float) -> dict[str, float]:
    return {"time_s": time_s, "bytes": nbytes, "calls": calls}


def _stored(store: Store, **report: object) -> list:
    job = store.create_job(name="view", spec=JobSpec.model_validate(tiny_spec()),
                           plan=stored_plan(dp=2), world_size=2, cpus=1, gpus=0).id
    rows = [StepReport.model_validate({"rank": r, "step": 1, "loss": 2.0, "step_time_s": 1.0,
                                       "tokens_per_s": 100.0, **report}).row()
            for r in (0, 1)]
    MetricsIngest(store).record(job_id=job, attempt=1, world_size=2, rows=rows)
    return store.list_metrics(job_id=job, rank=None)


def test_a_stored_step_reads_back_typed_and_splits_per_dimension(store: Store) -> None:
    ms = _stored(store, bubble_s=0.125, tokens=4096, epoch=0.5,
                 memory={"params_bytes": 10, "process_peak_bytes": 99},
                 comm={"tp": {"all_reduce": _op(0.25, 64.0, 4.0)},
                       "dp": {"all_reduce": _op(0.125, 32.0, 1.0),
                              "all_gather": _op(0.0625, 16.0, 2.0)}},
                 custom={"accuracy": 0.75, "note": "text"})
    assert [m.rank for m in ms] == [0, 1]
    step = ms[0].report
    assert step.comm is not None and step.timed
    assert step.comm["dp"]["all_gather"] == {"time_s": 0.0625, "bytes": 16.0, "calls": 2.0}
    assert isinstance(step.memory, MemoryReport)
    assert (step.memory.params_bytes, step.memory.process_peak_bytes,
            step.memory.grads_bytes) == (10, 99, None)
    assert step.memory_figures() == {"params_bytes": 10, "process_peak_bytes": 99}
    assert (step.bubble_s, step.tokens, step.epoch, step.loss_nonfinite) == \
        (0.125, 4096, 0.5, False)
    assert step.custom == {"accuracy": 0.75, "note": "text"}
    assert step.figures["bubble_s"] == 0.125 and "comm" not in step.figures
    split = ms[0].step_split()
    assert split is not None
    assert split.comm_s == {"tp": 0.25, "dp": 0.1875}
    assert (split.dim_s("tp"), split.dim_s("pp"), split.dim_s("dp")) == (0.25, 0.0, 0.1875)
    assert split.compute_s == pytest.approx(1.0 - 0.25 - 0.1875)
    assert split.step_time_s == 1.0


def test_an_untimed_or_uncounted_step_has_no_split(store: Store) -> None:
    [untimed, _] = _stored(store, timed=False,
                           comm={"pp": {"send": _op(0.0, 8.0, 1.0)}})
    assert untimed.report.comm == {"pp": {"send": _op(0.0, 8.0, 1.0)}}
    assert untimed.report.timed is False and untimed.step_split() is None
    [bare, _] = _stored(store, loss=float("nan"))
    assert bare.report.comm is None and bare.step_split() is None
    assert bare.report.loss_nonfinite and bare.loss is None
    assert bare.report.memory == MemoryReport() and bare.report.bubble_s is None
