"""What a tracker must do for the exporter, the errors it speaks in, and the run's text.

`TrackerSink` is met by `mlflow_sink.MlflowSink` and `tensorboard_sink.TensorBoardSink` (and
by fakes in the exporter's unit tests). A sink raises `TrackerDown` when the tracker did not
answer (the exporter retries with backoff, the cursor stays) and `TrackerRefused` when it
answered no to a batch for good (the batch is dropped and counted). `params` and `tags` are
what a run says about its job, shared by the sinks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from service.contract.states import JobState
from service.store import Job
from service.store.tracking_exports import Export, Sink
from service.tracking.scalars import StepScalars

PARAM_VALUE_MAX = 6000
"""MLflow's longest parameter value (`mlflow.utils.validation.MAX_PARAM_VAL_LENGTH`)."""
TAG_VALUE_MAX = 5000
DEFAULT_EXPERIMENT = "trident"
"""The experiment of a job with neither `tracking.experiment` nor a project."""
KEY_MAX = 250
"""MLflow's longest metric, parameter or tag name."""
HIDDEN = frozenset({"env", "secrets"})
"""Spec fields a run never carries: `env` is its owner's to read, `secrets` nobody's."""


class TrackerDown(Exception):
    """The tracker did not answer (refused, timed out, 5xx, 429): try again later."""


class TrackerRefused(Exception):
    """The tracker refused this batch for good (4xx): drop it, count it, go on."""


class TrackerSink(Protocol):
    kind: Sink
    target: str

    def open(self, job: Job) -> tuple[str | None, str | None]:
        """Make the job's run (or find the one made before), with its parameters and tags:
        its (run id, experiment id); (None, None) for a tracker without runs."""
        ...

    def discard(self, run_id: str) -> None:
        """Delete a run this exporter made but could not store (another one was)."""

    def send(self, job: Job, export: Export, steps: Sequence[StepScalars]) -> None:
        """Send `steps` (after `export`'s cursor, oldest first)."""

    def tell(self, job: Job, export: Export, *, final: bool) -> None:
        """Tell the tracker the job's state (`final`: it ended, every step was sent)."""

    def summarize(self, job: Job, export: Export, values: dict[str, float]) -> None:
        """Record figures of the whole run, once it ended (`exporter.goodput_metrics`)."""

    def close(self) -> None: ...


def spec_json(job: Job) -> dict[str, Any]:
    """The job's stored spec as JSON (without `secrets`, which no dump carries)."""
    return job.spec.model_dump(mode="json")


def experiment_of(job: Job) -> str:
    """The MLflow experiment of a job: its spec's, or its project, or `trident`."""
    return job.spec.tracking.experiment or job.project or DEFAULT_EXPERIMENT


def _flat(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        text = value if isinstance(value, str) else json.dumps(value)
        out[prefix[:KEY_MAX]] = text[:PARAM_VALUE_MAX]


def params(job: Job) -> dict[str, str]:
    """The run's parameters: the spec flattened (`model.layers`, `train.lr`, ...; not `env`
    nor `secrets`), the chosen layout (`layout.*`) and the plan's predictions (`plan.*`; a job
    that is not planned: `plan.planned` false and no prediction)."""
    out: dict[str, str] = {}
    _flat("", {k: v for k, v in spec_json(job).items() if k not in HIDDEN}, out)
    layout = job.plan.layout
    _flat("layout", {**layout.model_dump(mode="json"), "label": layout.label}, out)
    plan = job.plan.model_dump(mode="json")
    if not job.plan.planned:  # a command job without model: no prediction to log
        _flat("plan", {"planned": False, "chosen_by": plan.get("chosen_by")}, out)
        return out
    _flat("plan", {"step_s": plan["time"]["step_s"], "tokens_per_s": plan["tokens_per_s"],
                   "mfu": plan.get("mfu"), "chosen_by": plan.get("chosen_by", "spec"),
                   "memory_bytes": plan["memory"]["total"], "time": plan["time"],
                   "memory": plan["memory"]}, out)
    return out


def tags(job: Job, public_url: str | None) -> dict[str, str]:
    """The run's tags: who, which job, its state and page."""
    out = {"mlflow.runName": job.name, "mlflow.user": job.owner, "mlflow.source.name": "trident",
           "trident.job_id": str(job.id), "trident.owner": job.owner,
           "trident.project": job.project or "", "trident.state": job.state.value,
           "trident.layout": job.plan.layout.label}
    if public_url:
        out["trident.url"] = f"{public_url.rstrip('/')}/jobs/{job.id}"
    return out


RUN_STATUS = {JobState.QUEUED: "SCHEDULED", JobState.PLACING: "SCHEDULED",
              JobState.RUNNING: "RUNNING", JobState.RESTARTING: "RUNNING",
              JobState.SUCCEEDED: "FINISHED", JobState.FAILED: "FAILED",
              JobState.CANCELLED: "KILLED", JobState.PREEMPTED: "RUNNING"}
"""A job's state as an MLflow run status."""

