"""What a rank reports to the controller: its steps, its heartbeat, a probe's rows.

Worker reports cross a process boundary, so they are validated here before anything is
stored. What the controller asks of the ranks' cluster (`Launcher`, `WorkerGroup`) is
`service.cluster.data_plane`.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from typing_extensions import TypedDict  # pydantic takes typing's only from Python 3.12


class MemoryReport(BaseModel):
    """Bytes a rank really holds, measured (see `workers.monitor.memory`). A custom entrypoint may
    leave any of them out (None); the built-in trainer reports the process peak every step and
    the others on the steps its monitor measures (`monitor.memory_every`), None (not
    measured) on the rest."""

    model_config = ConfigDict(extra="forbid")

    params_bytes: int | None = Field(default=None, ge=0)
    """Parameters the rank keeps between steps on its device: its TP/PP shard, or its ZeRO-3
    partition. The categories are defined in docs/planner-model.md ("What each category
    means"), as the planner counts them."""
    grads_bytes: int | None = Field(default=None, ge=0)
    """Gradients right after the optimizer step (ZeRO-1/2/3: the rank's partition), each
    tensor's own bytes: the rest of a reduction bucket they are views of is a bucket. Those
    offloaded to host memory are `host_grads_bytes`."""
    optimizer_bytes: int | None = Field(default=None, ge=0)
    """Optimizer states: Adam moments, step counters and fp32 master weights of the rank's
    partition; offloaded ones are `host_optimizer_bytes`."""
    host_params_bytes: int | None = Field(default=None, ge=0)
    """Parameters DeepSpeed keeps in host memory (ZeRO-3's partition under parameter
    offload)."""
    host_grads_bytes: int | None = Field(default=None, ge=0)
    """Gradients in host memory under optimizer offload: the partitions the step reads."""
    host_optimizer_bytes: int | None = Field(default=None, ge=0)
    """Optimizer states in host memory under optimizer offload."""
    offload_buffers_bytes: int | None = Field(default=None, ge=0)
    """ZeRO-1/2 offload's host staging buffers: the partition's copy in the training
    precision, the largest parameter's gradient buffer, the per-parameter gradient
    accumulation buffers."""
    activations_peak_bytes: int | None = Field(default=None, ge=0)
    """Peak bytes of tensors the embedding and the blocks saved for backward so far, over the
    steps measured (saved-tensor hooks; parameters, and what the head and the loss save, are
    not activations)."""
    logits_peak_bytes: int | None = Field(default=None, ge=0)
    """Peak bytes the head and the loss save for backward (final norm and head inputs, the
    loss's log-softmax), apart from `activations_peak_bytes` (the blocks' and the
    embedding's)."""
    gathered_peak_bytes: int | None = Field(default=None, ge=0)
    """ZeRO-3's gathered and prefetched parameters: peak bytes of the whole weights held at once
    (those kept whole under `stage3_param_persistence_threshold` included); 0 without ZeRO-3."""
    buckets_bytes: int | None = Field(default=None, ge=0)
    """Communication buckets DeepSpeed holds (gradient reduction, ZeRO-3's reduce bucket)."""
    framework_bytes: int | None = Field(default=None, ge=0)
    """What the framework itself holds: on CPU the process's anonymous memory (`RssAnon` +
    `RssShmem`: not the library pages it maps) once torch, DeepSpeed and the trainer are
    imported and the process group is up, before the model."""
    not_measured: dict[Annotated[str, Field(max_length=64)],
                       Annotated[str, Field(max_length=1024)]] | None = Field(
        default=None, max_length=16)
    """Categories this rank cannot measure, each with the reason (their bytes are in the
    process peak, not in another category)."""
    process_peak_bytes: int | None = Field(default=None, ge=0)
    """The process's peak: on CPU its own memory's (`anon_peak`: the peak RSS less the
    library pages it maps, `workers.monitor.memory`; `rss_peak`: the whole peak RSS, as light
    ranks and reports of before read it), on GPU `torch.cuda.max_memory_allocated`."""
    process_peak_source: Literal["anon_peak", "rss_peak", "cuda_max_allocated"] | None = None


class CommOpStats(TypedDict):
    """One op's collectives of one dimension in one step
    (`workers.monitor.comm_timer.CommTimer`)."""

    time_s: float
    """Seconds in the op's calls; 0 on steps that were not timed (see `StepReport.timed`)."""
    bytes: float
    """Bytes moved, nccl-tests sizes (see `service.monitor.bandwidth`)."""
    calls: float


CustomValue = bool | int | float | Annotated[str, Field(max_length=1024)] | None
"""A value a custom entrypoint may report beside the fields of `StepReport`."""
CUSTOM_MAX = 64
"""Custom metrics one step report may carry."""
CUSTOM_NAME_MAX = 64
"""Longest custom metric name."""
CUSTOM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
"""A custom metric's name: a valid name for MLflow, TensorBoard and a Prometheus label."""
DERIVED = frozenset({"mfu"})
"""Names the control plane gives figures it derives from a step (`service.tracking.scalars`)."""

METRIC_COLUMNS = frozenset({"rank", "step", "loss", "step_time_s", "tokens_per_s", "lr",
                            "grad_norm"})
"""Fields of `StepReport` stored as columns of a metrics row; the rest goes to its `data`."""


GUARD_EVENTS = ("guard_skip", "guard_spike", "guard_rollback")
"""The job events the controller stores from the training guard's step reports
(`service.control.worker_reports`), counted on `/metrics` (`trident_job_guard_events_total`)
and marked on the loss chart."""


GUARD_STOP = "training guard stopped the job: "
"""How a rank's error begins when the training guard stops the job
(`workers.trainer.guard.GuardStop`): the controller fails it without a retry."""


class GuardRollback(BaseModel):
    """A rollback of the training guard (`workers.trainer.guard`): the model, optimizer and
    data position of the checkpoint of step `to_step` loaded, the samples of the steps that
    caused it never read again."""

    model_config = ConfigDict(extra="forbid")

    to_step: int = Field(ge=1, le=10_000_000)
    """The checkpoint's step, loaded after the reporting step."""
    samples: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=2,
                                                                     max_length=2)]] = \
        Field(max_length=10_000)
    """[first, end) global sample numbers of each global batch now skipped."""
    reason: str = Field(max_length=500)


class StepReport(BaseModel):
    """One rank's account of one optimizer step.

    Built by the rank (`workers.trainer.train`; a custom entrypoint builds one or passes a dict
    that is validated into one), completed by the rank actor with the step's collectives (`comm`,
    `timed`), sent across Ray as `model_dump()`, validated again by the controller and stored
    by `row()`: the columns of `METRIC_COLUMNS`, everything else once in `data`.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["step"] = "step"
    rank: int = Field(ge=0, le=65535)
    step: int = Field(ge=1, le=10_000_000)
    """1-based optimizer step."""
    loss: float | None = None
    """Mean loss over the global batch; the same value on every rank (None: not finite, or
    not reported)."""
    loss_nonfinite: bool | None = None
    """True when the loss was NaN or infinite (stored as None): set on validation, so that a
    diverged step is told from one that reported no loss (the controller's rule on a job
    whose last losses were not finite: `Settings.nonfinite_loss_steps`)."""
    step_time_s: float = Field(ge=0, le=86400)
    """Wall time of this rank's optimizer step."""
    tokens_per_s: float | None = Field(ge=0)
    """Global tokens (global_batch * seq_len) per second of this rank's step time (None:
    not known, a command job without a model whose script reports none)."""
    lr: float | None = Field(default=None, ge=0, le=10)
    """The learning rate this optimizer step ran at (the schedule's, `TrainSpec.lr_at`)."""
    grad_norm: float | None = Field(default=None, ge=0)
    """The global L2 norm of the gradient over every rank, before clipping (None: not
    finite, as on an fp16 overflow, or not measured)."""
    memory: MemoryReport = Field(default_factory=MemoryReport)
    tp_rank: int | None = Field(default=None, ge=0)
    pp_rank: int | None = Field(default=None, ge=0)
    dp_rank: int | None = Field(default=None, ge=0)
    attempt: int | None = Field(default=None, ge=0)
    """The worker group's attempt number as the rank knows it."""
    resumed_from: int | None = Field(default=None, ge=0)
    """Step of the checkpoint this attempt resumed from (0: started fresh)."""
    resume_skipped: list[Annotated[str, Field(max_length=2000)]] | None = Field(
        default=None, max_length=1000)
    """With an attempt's first step: the newer complete tags it did not resume from because
    their files no longer match their checksums, each `step <N>: why`
    (`workers.checkpoint.saving.agreed_resume`)."""
    checkpoint: str | None = None
    """Directory of the checkpoint saved after this step, if any."""
    checkpoint_error: str | None = Field(default=None, max_length=4000)
    """Why the checkpoint due after this step was not saved (the disk is full, ...): its
    partial tag is removed, the newest complete one stays the one to resume from, and
    training goes on; the controller stores it as a `checkpoint` event of the job."""
    checkpoint_step: int | None = Field(default=None, ge=1, le=10_000_000)
    """The step of `checkpoint` (or of `checkpoint_error`) when it is not this step's: a
    save in the background (`checkpoint.async`) is reported with the step at which it was
    complete."""
    checkpoint_bytes: int | None = Field(default=None, ge=0, le=1 << 60)
    """Size on disk of the checkpoint saved after this step (rank 0's count)."""
    checkpoints_removed: list[Annotated[int, Field(ge=1, le=10_000_000)]] | None = Field(
        default=None, max_length=10_000)
    """Steps of the older tags deleted after this step's checkpoint was complete (retention:
    `checkpoint.keep_last`, `keep_every`)."""
    comm: dict[str, dict[str, CommOpStats]] | None = None
    """Collectives of this step: dim (tp, pp, dp, or another group's name) -> op -> stats.
    Added by the rank actor's `CommTimer`; None when the step's collectives were not counted."""
    timed: bool = True
    """Whether `comm` carries times: False on GPU steps between CUDA-event samples, which
    count bytes and calls only."""
    bubble_s: float | None = Field(default=None, ge=0, le=86400)
    """Seconds of the step this rank's pipeline stage waited for its neighbouring stages
    (`workers.monitor.bubble`): the part of its PP time beyond the transfers themselves. 0 without
    pipeline parallelism; None when not measured (a custom entrypoint, a GPU step between
    samples)."""
    eval_loss: float | None = None
    """Mean validation loss over `data.eval_batches` global batches, on the steps that
    evaluated (every `data.eval_every`, and the last); the same value on every rank."""
    tokens: int | None = Field(default=None, ge=0)
    """Tokens the job has trained on after this step (consumed samples * seq_len)."""
    epoch: float | None = Field(default=None, ge=0)
    """Passes over the first training corpus after this step (kind `tokens`)."""
    ended_at: float | None = Field(default=None, ge=0, le=1e11)
    """When this rank's optimizer update of the step ended (Unix seconds, the rank's clock):
    the goodput ledger's step boundary (`service.store.goodput`; None: the time the step was
    stored stands in)."""
    eval_s: float | None = Field(default=None, ge=0, le=86400)
    """Seconds the evaluation after this step took (None: none ran)."""
    save_s: float | None = Field(default=None, ge=0, le=86400)
    """Seconds the checkpoint save after this step kept the loop waiting (None: none): with
    `checkpoint.async`, the snapshot to host memory (and any wait for the save before)."""
    load_s: float | None = Field(default=None, ge=0, le=86400)
    """With an attempt's first step: seconds it took to load the checkpoint it resumed
    from (None: it started fresh)."""
    compile_s: float | None = Field(default=None, ge=0, le=86400)
    """Seconds `torch.compile` spent during this step (`train.compile`: the attempt's first
    step traces and builds the blocks; None: nothing compiled). Part of the step's
    `step_time_s`, and so of the goodput ledger's training loop: it happens inside the step's
    first forward and backward, not beside them as an evaluation or a save does."""
    first_sample: int | None = Field(default=None, ge=0)
    """Global number of this step's first sample, as the loaders of the rank's DP group
    returned it: the step read samples [first_sample, first_sample + batch) of the job's
    sample order (`workers.trainer.data`). None on a pipeline stage that reads no data."""
    batch: int | None = Field(default=None, ge=1)
    """Global samples this step read (its global batch, the ramp's while `train.batch_ramp`
    ramps), counted from what the loaders of the rank's DP group returned."""
    drawn: dict[Annotated[str, Field(max_length=4096)], Annotated[int, Field(ge=0)]] | None = \
        Field(default=None, max_length=64)
    """Samples drawn so far from each training corpus, by path (kind `tokens`)."""
    skipped: bool | None = None
    """True when the training guard skipped this step's optimizer update on every rank
    (`workers.trainer.guard`): `guard` says why. The step still counts (`train.steps`)."""
    guard: str | None = Field(default=None, max_length=500)
    """What the training guard found at this step: why its update was skipped, or the spike
    it judged after the update (a pipeline's loss is known only after its step)."""
    skipped_steps: int | None = Field(default=None, ge=0, le=10_000_000)
    """Steps the guard skipped in this attempt so far, this one included."""
    rollback: GuardRollback | None = None
    """Set on the step after which the guard rolled back to the newest checkpoint."""
    rollbacks: int | None = Field(default=None, ge=0, le=10_000_000)
    """Rollbacks of the guard in this attempt so far, this step's included."""
    custom: dict[Annotated[str, Field(max_length=CUSTOM_NAME_MAX)], CustomValue] | None = \
        Field(default=None, max_length=CUSTOM_MAX)
    """Whatever else a custom entrypoint wants kept with the step (stored as is): at most
    `CUSTOM_MAX` names of `CUSTOM_NAME` form, none a field's of this report; those with
    number values are metrics, sent to the trackers, compared and exported on `/metrics`
    under their names."""

    @field_validator("grad_norm", mode="before")
    @classmethod
    def _finite_norm_or_none(cls, v: Any) -> Any:
        # DeepSpeed reports inf on an fp16 overflow (the step is skipped): no norm then.
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v

    @model_validator(mode="before")
    @classmethod
    def _note_nonfinite_loss(cls, data: Any) -> Any:
        loss = data.get("loss") if isinstance(data, dict) else None
        if isinstance(loss, float) and not math.isfinite(loss):
            return {**data, "loss_nonfinite": True}
        return data

    @field_validator("loss", "eval_loss")
    @classmethod
    def _finite_or_none(cls, v: float | None) -> float | None:
        # A diverged run reports nan/inf; JSON cannot carry them, so store None and say so.
        if v is not None and not math.isfinite(v):
            return None
        return v

    @field_validator("custom")
    @classmethod
    def _custom_names(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in v or {}:
            if not CUSTOM_NAME.match(name):
                raise ValueError(f"custom metric name {name!r}: letters, digits, '_', '.' and"
                                 " '-', starting with a letter or '_'")
            if name in StepReport.model_fields or name in DERIVED:
                raise ValueError(f"custom metric name {name!r} is taken by the step report"
                                 " (one of its fields, or a figure derived from them)")
        return v

    @model_validator(mode="after")
    def _bubble_within_step(self) -> StepReport:
        if self.bubble_s is not None and self.bubble_s > self.step_time_s:
            raise ValueError(f"bubble_s ({self.bubble_s}) exceeds step_time_s"
                             f" ({self.step_time_s}): the bubble is part of the step")
        return self

    def row(self) -> dict[str, Any]:
        """A metrics row for `MetricsIngest.record`; unset (None) fields are left out of `data`."""
        out = self.model_dump(include=set(METRIC_COLUMNS))
        out["data"] = self.model_dump(exclude={"kind", *METRIC_COLUMNS}, exclude_none=True)
        return out


Phase = Literal["setup", "probe", "forward", "backward", "optimizer", "checkpoint", "done"]
"""Where in its work a rank is (`HeartbeatReport.phase`)."""


class HeartbeatReport(BaseModel):
    """What one rank is doing now, and since when: `workers.runtime.heartbeat.Heartbeat.read()`.

    Sent across Ray with every poll as `model_dump()` and validated by the worker group in
    the controller's process (a rank of a group started by an older controller may speak an
    older form); the controller judges hangs by it (`service.monitor.hang`) and keeps each
    rank's last one for the API (`service.store.heartbeats`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0, le=65535)
    step: int = Field(ge=-1, le=10_000_000)
    """The step the rank is in (-1 before its first, and while it probes)."""
    phase: Phase
    collective: str | None = Field(default=None, max_length=64)
    """The collective the rank is blocked in (None outside collectives)."""
    dim: str | None = Field(default=None, max_length=16)
    """That collective's dimension (tp, pp, dp, or another group's name)."""
    group: list[int] | None = Field(default=None, max_length=65536)
    """That collective's group, as global ranks."""
    time: float
    """Wall time of the rank's last change (its clock; the controller sets its own clock's
    `receive time - age_s` before judging, see `AttemptHealth.polled`)."""
    age_s: float = Field(ge=0)
    """Monotonic seconds since that change (immune to clock skew between nodes)."""


class ProbeRowModel(BaseModel):
    """One bandwidth measurement: one op at one size over one group (nccl-tests terms)."""

    model_config = ConfigDict(extra="allow")

    dim: str = Field(max_length=16)
    group: list[int] = Field(max_length=65536)
    op: str = Field(max_length=32)
    bytes: int = Field(ge=0)
    time_s: float = Field(ge=0)
    algbw: float = Field(ge=0)
    busbw: float = Field(ge=0)


class ProbeReport(BaseModel):
    """A rank's probe rows for the groups it reports (first rank of a group, sender of a pair)."""

    kind: Literal["probe"]
    rank: int = Field(ge=0, le=65535)
    rows: list[ProbeRowModel] = Field(max_length=10000)
    round: int = Field(default=0, ge=0, le=10_000_000)
    """0: the probe before training; n: the n-th during training (`monitor.probe_every_s`)."""
    step: int | None = Field(default=None, ge=0, le=10_000_000)
    """The step after which a probe during training ran."""


class ClusterProbeReport(BaseModel):
    """A rank's part of `trident probe`: its matmul FLOP/s and the rows it reports."""

    kind: Literal["cluster_probe"]
    rank: int = Field(ge=0, le=65535)
    node_id: str = Field(max_length=128)
    matmul_flops: dict[str, float]
    rows: list[ProbeRowModel] = Field(max_length=10000)
