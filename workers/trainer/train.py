"""The per-rank trainer: what one rank of a job runs, for every TP x PP x DP x ZeRO layout.

Two programs of `workers.runtime.programs` live here: the built-in trainer (`train_rank`) and a
custom entrypoint (`entrypoint_rank`), which share the set-up and tear-down (`rank_session`). Two
callers: the Ray actor of `workers.launch.group` runs them on a thread (one actor per rank,
rendezvous given in `RankContext`), and `python -m workers.trainer.train --spec SPEC.yaml` runs
the same function under torchrun (rendezvous read from torchrun's environment), for debugging
and as the baseline without orchestration.

Each rank is given its row of the job's plan (`RankContext.plan`, a
`service.planner.stored.RankPlan`: its stage, the layers it builds, its groups): the Ray
actor gets the row of the stored plan from the controller's launcher; without a controller
(torchrun, tests) `planned_row` takes it from the plan the control plane would store. The
trainer builds from that row and never works the split out again.

`train_rank` reads top to bottom: set up torch.distributed and the TP/PP/DP groups, build the
model (each rank draws only its shards of the seeded weights: layout-invariant, and under
ZeRO-3 partitioned over DP as each module is built: `construction`), parallelize
(tensor parallel inside the layers, then activation checkpointing inside the blocks, then ZeRO
wrapping last through `deepspeed.initialize`), resume, loop (report every optimizer step, save
every `checkpoint.every_steps`: a save that fails is reported and the loop goes on), tear down.
A spec with `entrypoint` runs that function instead of the built-in GPT loop, between the same
set-up and tear-down, with the same data (`workers.trainer.evaluation.open_data`,
`TrainContext.data`). A preempted job's ranks (`RankContext.save_now`) save where they stop.
One module because it is one rank's run read top to bottom; its parts (data, model, pipeline,
checkpoints, memory) are modules of their own.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from service.contract import ds_config
from service.contract.reports import GuardRollback, StepReport
from service.contract.spec import JobSpec
from service.files import tag_steps
from service.planner import evaluate
from service.planner.shape import ModelShape
from service.planner.stored import RankPlan, StoredPlan, plan_json
from workers.checkpoint import background, hf_weights
from workers.checkpoint import saving as checkpoint
from workers.modeling import compiled
from workers.modeling.model import GPT, Block, building, loss_for
from workers.modeling.tp import DeepSpeedMpu, RankGroups, build_groups, dp_all_reduce, world_any
from workers.modeling.vocab import IGNORE
from workers.monitor import memory
from workers.monitor.bubble import BubbleMeter
from workers.runtime import rendezvous
from workers.runtime.deepspeed_import import deepspeed
from workers.runtime.programs import RankContext, Report
from workers.trainer import data, evaluation, guard, recipe

CustomReport = Callable[[StepReport | dict[str, Any]], None]
"""A custom entrypoint's `TrainContext.report`: a `StepReport`, or a dict validated into one
(values beyond its fields go in its `custom` dict)."""


def steps_writer(ctx: RankContext, *saving: StepReport) -> Callable[[str], None] | None:
    """What `checkpoint.save` writes into each tag of this rank (`service.files.tag_steps`): its
    unacknowledged step reports and `saving`, the report of the step being saved (reported
    once the tag is complete); None without a controller."""
    pending = ctx.pending
    if pending is None:
        return None

    def write(path: str) -> None:
        tag_steps.write(path, job_id=ctx.writer.job_id if ctx.writer else None,
                                attempt=ctx.attempt, world_size=ctx.world_size,
                                rank=ctx.rank,
                                reports=[*pending(), *(r.model_dump() for r in saving)])

    return write


def planned_row(spec: JobSpec, rank: int) -> RankPlan:
    """Rank `rank`'s row of the plan the control plane stores for `spec`, for a run without a
    controller (`main` under torchrun, tests, benches); the controller's launcher sends each
    rank its row of the stored plan."""
    return StoredPlan.from_json(plan_json(evaluate(spec))).rank_plan(rank)


@dataclass
class TrainContext:
    """What a custom `entrypoint` function receives on every rank (after set-up)."""

    spec: JobSpec
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    groups: RankGroups
    """This rank's coordinates and its tp/pp/dp process groups."""
    ds_config: dict[str, Any]
    """The DeepSpeed config the built-in trainer would use for this layout."""
    report: CustomReport
    checkpoint_dir: str | None
    resume_step: int
    """Steps already done by the newest complete checkpoint (0: start fresh)."""
    stop: threading.Event
    plan: RankPlan
    """This rank's row of the job's plan: its stage, the layers it builds, its groups."""
    attempt: int = 0
    data: data.DataSource | None = None
    """The job's data as the built-in trainer reads it (`workers.trainer.data`):
    `micro_batches(step)`
    is this rank's DP replica's micro-batches of step `step` (0-based), `eval_micro_batches`
    the validation ones, `progress(samples)` the tokens, epoch and per-corpus draws of the
    consumed samples; `micro_batches_at(consumed, count)` reads the global batch of `count`
    samples after `consumed`. Pass the samples consumed to `checkpoint.save(...,
    consumed_samples=...)`: `checkpoint.load` returns them on resume."""
    save_steps: Callable[[str], None] | None = None
    """Pass it to `checkpoint.save(..., steps=...)`: each tag then carries this rank's step
    reports the controller has not acknowledged (report a step before saving it), stored
    should the attempt end before they are polled (`service.files.tag_steps`)."""

    def should_stop(self) -> bool:
        """Collective: whether any rank was asked to stop; call it on every rank each step."""
        return world_any(self.stop.is_set(), self.device)


def train_rank(spec: JobSpec, ctx: RankContext, report: Report, stop: threading.Event,
               step_started: Callable[[int], None] | None = None) -> None:
    """The built-in trainer (`workers.runtime.programs.TRAINER`): set up torch.distributed, build
    the model, train spec.train.steps steps, report, tear down. Exceptions propagate; `stop` ends
    the run cleanly between steps. The built-in trainer calls `step_started(step)` where a
    step's timed work begins (the rank actor's communication timer starts the step there).
    A spec with `entrypoint` runs that function instead, as `entrypoint_rank` does (torchrun's
    `main` and the tests run every spec through here)."""
    with rank_session(spec, ctx) as s:
        if spec.entrypoint:
            _run_entrypoint(spec, ctx, s, report, stop)
        else:
            _train_gpt(spec, ctx, s.device, s.groups, s.ds_config, report, stop, s.source,
                       step_started)


def entrypoint_rank(spec: JobSpec, ctx: RankContext, report: Report, stop: threading.Event,
                    step_started: Callable[[int], None] | None = None) -> None:
    """A spec's custom entrypoint (`workers.runtime.programs.ENTRYPOINT`) between the trainer's
    set-up
    and tear-down (`rank_session`); it marks no step starts (`step_started` is not called)."""
    with rank_session(spec, ctx) as s:
        _run_entrypoint(spec, ctx, s, report, stop)


# --- set up and tear down -----------------------------------------------------------------------

@dataclass(frozen=True)
class RankSession:
    """What the trainer's set-up gives the program it runs."""

    device: torch.device
    groups: RankGroups
    ds_config: dict[str, Any]
    source: data.DataSource


@contextmanager
def rank_session(spec: JobSpec, ctx: RankContext) -> Iterator[RankSession]:
    """Set up (`setup_rank`), claim the checkpoint folder before any rank reads it, build the
    groups and check them against the rank's row of the plan, open the data; tear down after,
    waiting for the peers only when the program ended well (peers may be gone after an error:
    a barrier would hide it)."""
    device = setup_rank(spec, ctx)
    try:
        checkpoint.claim_folder(ctx.checkpoint_dir, ctx.writer)  # before any rank reads it
        groups = build_groups(spec.layout.dims, ctx.rank)
        _check_row(ctx.plan, groups)
        ds_config = deepspeed_config(spec, device)
        source = evaluation.open_data(spec, ctx.rank, groups, device, ctx.server,
                                      ctx.writer.owner if ctx.writer else "")
        yield RankSession(device=device, groups=groups, ds_config=ds_config, source=source)
    except BaseException:
        teardown_rank(wait_for_peers=False)
        raise
    teardown_rank(wait_for_peers=True)


def setup_rank(spec: JobSpec, ctx: RankContext) -> torch.device:
    """The job's environment, the process group on the job's master address, DeepSpeed's
    distributed state and the seed: the set-up every DeepSpeed program shares (scripts that
    start ranks by hand call it too, `workers.rank.script_rank`). Returns the rank's device."""
    for key, value in spec.env.items():
        os.environ[key] = value
    os.environ.update(MASTER_ADDR=ctx.master_addr, MASTER_PORT=str(ctx.master_port),
                      RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size),
                      LOCAL_RANK=str(ctx.local_rank))
    use_gpu = torch.cuda.is_available() and spec.resources.gpus_per_worker > 0
    if not use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    layout = spec.layout
    if layout.tp * layout.pp * layout.dp != ctx.world_size:
        raise ValueError(f"tp({layout.tp}) * pp({layout.pp}) * dp({layout.dp}) ="
                         f" {layout.tp * layout.pp * layout.dp} != world size {ctx.world_size}")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if spec.train.precision == "fp16":
        from deepspeed.accelerator import get_accelerator
        if not get_accelerator().is_fp16_supported():
            raise ValueError("train.precision: fp16 needs a device with fp16 arithmetic (a CUDA"
                             f" GPU); {get_accelerator().device_name()} has none, use bf16")
    # With one GPU visible per actor (Ray sets CUDA_VISIBLE_DEVICES) the device index is 0.
    gpu = ctx.local_rank % max(1, torch.cuda.device_count()) if use_gpu else 0
    if use_gpu:
        torch.cuda.set_device(gpu)
    # The group first, on the job's master address (workers.runtime.rendezvous); DeepSpeed then
    # finds it initialised. Its timeout and device binding are what DeepSpeed would have used.
    rendezvous.init_process_group(
        "nccl" if use_gpu else "gloo", rank=ctx.rank, world_size=ctx.world_size,
        master_addr=ctx.master_addr, port=ctx.master_port,
        timeout=deepspeed.constants.default_pg_timeout,
        device_id=torch.device("cuda", gpu) if use_gpu and ctx.world_size > 1 else None)
    deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo",
                               auto_mpi_discovery=False, verbose=False,
                               rank=ctx.rank, world_size=ctx.world_size)
    torch.manual_seed(spec.train.seed)
    return torch.device("cuda", gpu) if use_gpu else torch.device("cpu")


def teardown_rank(wait_for_peers: bool) -> None:
    """Destroy every process group so the same process can run another attempt."""
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
    from deepspeed.utils import groups as ds_groups
    for name in ("_DATA_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_WORLD_GROUP", "mpu"):
        if hasattr(ds_groups, name):
            setattr(ds_groups, name, {} if name.startswith("_EXPERT") else None)


def deepspeed_config(spec: JobSpec, device: torch.device | None = None) -> dict[str, Any]:
    """The DeepSpeed config of this layout on `device` (`service.contract.ds_config`, which `trident
    plan --deepspeed-config` prints)."""
    return ds_config.deepspeed_config(spec, cuda=device is not None and device.type == "cuda")


# --- the built-in GPT trainer -------------------------------------------------------------------

def _train_gpt(spec: JobSpec, ctx: RankContext, device: torch.device, groups: RankGroups,
               ds_config: dict[str, Any], report: Report, stop: threading.Event,
               source: data.DataSource,
               step_started: Callable[[int], None] | None = None) -> None:
    layout, t = spec.layout, spec.train
    shape = ModelShape.from_spec(spec.planned_model)  # what the planner counted; built as it is
    if layout.sequence_parallel and shape.seq_len % layout.tp:
        raise ValueError(f"parallel.sequence_parallel: tp({layout.tp}) does not divide"
                         f" seq_len({shape.seq_len})")

    # Build and parallelize: tensor parallel and activation checkpointing live inside the
    # layers (workers.modeling.model); ZeRO wraps last, in deepspeed.initialize, over the DP group.
    # The pipeline's waits for neighbouring stages (none without a pipeline: a bubble of 0).
    bubble = BubbleMeter(cuda=device.type == "cuda",
                         sample_every=spec.monitor.comm_sample_every) if layout.pp > 1 else None
    # The framework's bytes: imports and process group, before the model. `torch._dynamo` is
    # one of its imports (every rank's first optimizer imports it, about 74 MB resident on
    # CPU): imported here, it is counted there on every host, not only where a fork server
    # preloaded it. The process peak counts from here (`memory.training_start`).
    import torch._dynamo  # noqa: F401

    framework = memory.training_start()
    engine = build_engine(spec, shape, ctx.plan, device, groups, ds_config, bubble)
    recipe.mend_unfused_optimizer(engine.optimizer, list(engine.module.parameters()), groups,
                                  t.grad_clip)  # 16-bit ZeRO 0: DeepSpeed's wrapper, mended
    _check_stage(engine.module, ctx.plan)

    inner = memory.innermost_optimizer(engine.optimizer)
    if layout.virtual_stages == 1 and not layout.zero and t.precision == "fp32":
        # DeepSpeed's fp32 path without ZeRO clips with a norm it keeps nowhere: clip here,
        # by the same rule, where the engine then reads the norm (workers.trainer.recipe).
        engine.clip_fp32_gradients = lambda: None  # type: ignore[union-attr,attr-defined]
        recipe.clip_before_step(inner, list(engine.module.parameters()), groups, t.grad_clip)

    # The guards (workers.trainer.guard): the gate skips the inner optimizer step of a bad
    # step on every rank alike; the keeper judges spikes and runs of skipped steps.
    gate = guard.StepGate(inner, guard.engine_norm(engine, inner, layout.virtual_stages > 1))
    keeper = guard.Guard(t.guard, pipelined=layout.pp > 1)
    fault = _LossFault(ctx.loss_factor)
    if layout.pp > 1:
        fault.wrap_pipeline(engine)

    start = consumed = 0  # steps done, and the global samples they read
    skipped: list[str] | None = None  # damaged tags passed over: said with the first step
    load_s: float | None = None  # the load's time: said with the first step too
    if ctx.checkpoint_dir:
        resume = checkpoint.agreed_resume(ctx.checkpoint_dir)
        skipped = resume.skipped or None
        if resume.step:
            t_load = time.perf_counter()
            start, samples = checkpoint.load(engine, ctx.checkpoint_dir, resume.step, spec,
                                             groups)
            # A tag written without its samples: a run that kept one global batch.
            consumed = start * t.global_batch if samples is None else samples
            load_s = time.perf_counter() - t_load
    source.cover(consumed + (t.steps - start) * t.global_batch)
    clock = compiled.CompileClock() if t.compile else None
    meter = memory.MemoryMonitor(engine.module, engine.optimizer, device,
                                 spec.monitor.memory_every, start + 1, t.steps,
                                 ctx.plan.memory_capacity_bytes,
                                 ctx.plan.memory_predicted_bytes, framework)

    last: StepReport | None = None
    pending: background.Pending | None = None  # checkpoint.async: the save being written
    planned = t.global_batch  # the batch the engine was built for
    for step in range(start, t.steps):
        # Every rank stops at the same step boundary, even when `stop` reached some ranks a
        # step later than others: a rank that left alone would leave its peers in a collective.
        if world_any(stop.is_set(), device):
            if pending is not None and last is not None:
                last, pending = _settle(pending, last, report), None
            # The last step's own tag, not an earlier one marked with its report.
            own_tag = last is not None and last.checkpoint is not None and \
                last.checkpoint_step in (None, last.step)
            if ctx.checkpoint_dir and last is not None and not own_tag and \
                    ctx.save_now is not None and world_any(ctx.save_now.is_set(), device):
                report(checkpoint.saved_now(engine, ctx.checkpoint_dir, last, spec, consumed,
                                            steps_writer(ctx)))
            break
        if bubble is not None:
            bubble.begin_step(step + 1)
        if step_started is not None:
            step_started(step + 1)
        t0 = time.perf_counter()
        lr = t.lr_at(step + 1)
        recipe.set_lr(engine.optimizer, lr)
        consumed = keeper.past_skipped(consumed)  # never the batches a rollback skipped
        batch = t.batch_at(consumed)  # train.batch_ramp: a function of the samples consumed
        if batch != planned:  # DeepSpeed accumulates that many micro-batches from now on
            engine.set_train_batch_size(batch)
            planned = batch
        batches = source.micro_batches_at(consumed, batch)
        gate.begin()
        fault.at(step + 1)
        skipped_for: str | None = None
        with meter.track(step + 1):
            if layout.pp > 1:
                loss = float(engine.train_batch(data_iter=_to(batches, device)))
            else:
                def judge(mean: float, nonfinite: bool) -> None:
                    nonlocal skipped_for
                    skipped_for = keeper.skip_before_update(mean, nonfinite)
                    gate.skip_next = skipped_for is not None

                loss = _train_step(engine, _to(batches, device), groups, layout.dp,
                                   loss_for(shape, groups),
                                   batch // (t.micro_batch * layout.dp)
                                   if t.batch_ramp is not None else None,
                                   token_mean=getattr(source, "loss_mask", False),
                                   loss_factor=fault.factor, judge=judge)
        dt = time.perf_counter() - t0
        ended_at = time.time()
        waited = bubble.end_step() if bubble is not None else 0.0
        eval_loss = eval_s = None
        if source.eval_due(step + 1, t.steps):
            t_eval = time.perf_counter()
            eval_loss = evaluation.evaluate(engine, source, layout.pp, groups, device,
                                            loss_for(shape, groups))
            eval_s = time.perf_counter() - t_eval
        first_read, read = _read_span(source.read, groups, device)
        outcome = keeper.after_step(loss, gate.stepped, (consumed, consumed + batch),
                                    skipped_for)
        consumed += batch
        progress = source.progress(consumed)
        last = StepReport(
            rank=ctx.rank, step=step + 1, loss=loss,
            step_time_s=dt, tokens_per_s=batch * shape.seq_len / dt,
            lr=lr, grad_norm=_grad_norm(engine),
            bubble_s=None if waited is None else min(waited, dt),
            tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, dp_rank=groups.dp_rank,
            attempt=ctx.attempt, resumed_from=start, eval_loss=eval_loss,
            resume_skipped=skipped if step == start else None,
            ended_at=ended_at, eval_s=eval_s, load_s=load_s if step == start else None,
            compile_s=(clock.lap() or None) if clock is not None else None,
            tokens=progress.tokens, epoch=progress.epoch, drawn=progress.drawn,
            first_sample=first_read, batch=read or None,
            skipped=outcome.skipped or None, guard=outcome.why,
            skipped_steps=keeper.skipped_steps or None, rollbacks=keeper.rollbacks or None,
            memory=meter.report())
        due = bool(ctx.checkpoint_dir and spec.checkpoint.every_steps and
                   (step + 1) % spec.checkpoint.every_steps == 0)
        blocked = 0.0
        # A save in the background is marked at the first step boundary where every rank's
        # files are durable, and before the next save or a rollback (one in flight at a time).
        if pending is not None and (due or outcome.rollback is not None
                                    or not world_any(not pending.written(), device)):
            t_mark = time.perf_counter()
            last = last.model_copy(update=pending.finish().report_fields(pending.step))
            pending, blocked = None, time.perf_counter() - t_mark
            last = last.model_copy(update={"save_s": blocked})
        if outcome.rollback is not None:
            consumed, to_step = _roll_back(engine, ctx, spec, groups, keeper, outcome)
            source.cover(consumed + (t.steps - step - 1) * t.global_batch
                         + keeper.skipped_ahead(consumed))
            last = last.model_copy(update={"rollback": GuardRollback(
                to_step=to_step, samples=[list(r) for r in outcome.bad],
                reason=outcome.rollback)})
        elif due and ctx.checkpoint_dir and spec.checkpoint.background:
            # save_s: the snapshot to host memory only; the tag is reported once marked.
            t_save = time.perf_counter()
            pending = background.begin(engine, ctx.checkpoint_dir, step + 1, spec,
                                       progress.samples, steps_writer(ctx, last))
            last = last.model_copy(update={"save_s": blocked + time.perf_counter() - t_save})
        elif due and ctx.checkpoint_dir:
            # A save the disk refuses is reported with the step; training goes on. The tag
            # carries this step's report too: it is reported only after the save.
            t_save = time.perf_counter()
            saved = checkpoint.save(engine, ctx.checkpoint_dir, step + 1, spec,
                                    consumed_samples=progress.samples,
                                    steps=steps_writer(ctx, last))
            last = last.model_copy(update={
                **saved.report_fields(), "save_s": time.perf_counter() - t_save})
        report(last)
    if pending is not None and last is not None:
        _settle(pending, last, report)
    engine.destroy()


def _settle(pending: background.Pending, last: StepReport, report: Report) -> StepReport:
    """Collective: wait for the save in the background and mark it; report it with `last`
    again (the controller stores a step once, and records the tag); `last` with it when the
    save was of that step, else `last` as it was."""
    t_mark = time.perf_counter()
    saved = pending.finish()
    blocked = time.perf_counter() - t_mark
    own = pending.step == last.step
    done = last.model_copy(update={**saved.report_fields(pending.step),
                                   "save_s": blocked + ((last.save_s or 0.0) if own else 0.0)})
    report(done)
    return done if own else last


def build_engine(spec: JobSpec, shape: ModelShape, row: RankPlan, device: torch.device,
                 groups: RankGroups, ds_config: dict[str, Any],
                 bubble: BubbleMeter | None = None) -> Any:
    """This rank's stage of the model, built shard-only (`construction`) and wrapped in its
    engine: DeepSpeed's (pp = 1, or its pipeline engine), or the interleaved one."""
    layout, t = spec.layout, spec.train
    if layout.pp > 1 and layout.virtual_stages > 1:
        # DeepSpeed has no interleaved schedule: torch.distributed.pipelining (see module).
        from workers.trainer.interleaved import InterleavedEngine
        return InterleavedEngine(spec, shape, groups, row.layers, device, bubble)
    if layout.pp > 1:
        from workers.trainer.pipeline import build_pipeline
        with construction(spec, device, groups, ds_config):
            model = build_pipeline(shape, t.seed, layout.dims, groups, layout.recompute,
                                   row.stages, layout.sequence_parallel)
        hf_weights.load_init(model, spec, groups)  # init.from_hf: this rank's slices
        recipe.mark_norm_owners(model, groups)
        if t.compile:
            compiled.compile_blocks(model)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                          model_parameters=recipe.param_groups(model, t))
        if bubble is not None:
            bubble.attach_deepspeed(engine)
        return engine
    with construction(spec, device, groups, ds_config):
        model = GPT(shape, t.seed, groups, layout.recompute, layout.sequence_parallel)
    hf_weights.load_init(model, spec, groups)  # init.from_hf: this rank's slices
    recipe.mark_norm_owners(model, groups)
    if t.compile:
        compiled.compile_blocks(model)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=DeepSpeedMpu(groups),
                                      model_parameters=recipe.param_groups(model, t))
    return engine


PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextmanager
def construction(spec: JobSpec, device: torch.device, groups: RankGroups,
                 ds_config: dict[str, Any]) -> Iterator[None]:
    """Build this rank's stage holding only what the rank keeps.

    Every layer draws only its TP shard (`workers.modeling.seeded_init`), on `device`, in the dtype
    DeepSpeed trains the parameters in (it would cast them to it: same numbers, half the
    bytes of an fp32 build in 16-bit training). Under ZeRO-3, inside `deepspeed.zero.Init`
    over the DP group: each module's parameters are partitioned as soon as the module is
    built, so a rank holds its partition of what it built so far and one module's TP shard
    (the largest: the embedding or an MLP matrix), never the stage. The engine then finds the
    parameters partitioned (`deepspeed.initialize`).
    """
    with ExitStack() as stack:
        stack.enter_context(building(device, PARAM_DTYPES[spec.train.precision]))
        if spec.layout.zero == 3:
            stack.enter_context(deepspeed.zero.Init(
                config_dict_or_path=ds_config, mpu=DeepSpeedMpu(groups),
                data_parallel_group=groups.dp, mem_efficient_linear=False))
        yield


class _LossFault:
    """The job's nan and spike faults on this rank (`RankContext.loss_factor`): `factor` is
    what its loss is multiplied by in the current step (1.0: none)."""

    def __init__(self, source: Callable[[int], float] | None) -> None:
        self.source = source
        self.factor = 1.0

    def at(self, step: int) -> None:
        self.factor = self.source(step) if self.source is not None else 1.0

    def wrap_pipeline(self, engine: Any) -> None:
        """A pipeline's loss is computed inside its schedule, on the last stage: multiply
        it there (DeepSpeed's `module.loss_fn`, torch's schedule `_loss_fn`)."""
        if self.source is None:
            return
        holder = getattr(engine, "schedule", None) or engine.module
        name = "_loss_fn" if hasattr(holder, "_loss_fn") else "loss_fn"
        base = getattr(holder, name)

        def faulted(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = base(*args, **kwargs)
            return loss if self.factor == 1.0 else loss * self.factor

        setattr(holder, name, faulted)


def _roll_back(engine: Any, ctx: RankContext, spec: JobSpec, groups: RankGroups,
               keeper: guard.Guard, outcome: guard.Outcome) -> tuple[int, int]:
    """Collective: load the newest complete checkpoint (weights, optimizer, RNG) for the
    guard's rollback; returns the samples it had consumed and its step. The ranges of the
    batches that caused it are already in `keeper.skipping`. Raises GuardStop when there is
    no checkpoint."""
    directory = ctx.checkpoint_dir
    resume = checkpoint.agreed_resume(directory) if directory else None
    if directory is None or resume is None or not resume.step:
        raise guard.GuardStop(f"{outcome.rollback}; no checkpoint to roll back to")
    done, samples = checkpoint.load(engine, directory, resume.step, spec, groups)
    logging.getLogger(__name__).warning(
        "rank %d: rolled back to step %d (%s); samples %s skipped from now on", ctx.rank,
        done, outcome.rollback, outcome.bad)
    return (done * spec.train.global_batch if samples is None else samples), done


def _train_step(engine, batches, groups: RankGroups, dp: int, loss_fn,
                micro: int | None = None, token_mean: bool = False, loss_factor: float = 1.0,
                judge: Callable[[float, bool], None] | None = None) -> float:
    """One optimizer step of a single-stage engine: accumulate micro-batches, step, and return
    the global-batch mean loss (mean over micro-batches, then over DP replicas). `micro`: the
    step's micro-batches when their number changes between steps (a batch ramp): the last
    is marked as the accumulation boundary, DeepSpeed's count of micro-steps since the start
    no longer saying where it is.

    The loss stays on the device until the step's end (no host synchronisation per
    micro-batch). At the accumulation boundary, before the optimizer step, one all-reduce over
    the world of [loss sum (TP rank 0's, so that each DP replica counts once), not finite]
    gives every rank the global-batch mean and whether any rank's loss was not finite; `judge`
    (the guard, `workers.trainer.guard`) hears both before the update. `loss_factor`: the
    rank's nan or spike fault (tests).

    `token_mean` (kind chat): the loss is the mean over the tokens that train in the whole
    global batch (torchtitan's `global_valid_tokens`, transformers' `Trainer` with
    `average_tokens_across_devices`): micro-batch k's loss is its summed cross entropy times
    gas * dp over the global batch's count of labels that train (one all-reduce over DP),
    which DeepSpeed's 1/gas scaling and DP averaging turn into sum / count. When every label
    trains, the factor is exactly 1: the per-micro-batch mean of kind tokens."""
    batches = list(batches) if token_mean else batches
    weights: list[float] = []
    if token_mean:
        kept = torch.tensor([float((y != IGNORE).sum()) for _, y in batches],
                            dtype=torch.float64)
        every = kept.sum().to(engine.device)
        if dp > 1:
            dp_all_reduce(every, groups.dp)
        every_kept = max(float(every.cpu()), 1.0)
        weights = [float(k) * len(batches) * dp / every_kept for k in kept.tolist()]
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    mean = float("nan")
    for count, (x, y) in enumerate(batches):
        if micro is not None:
            engine.set_gradient_accumulation_boundary(count + 1 == micro)
        out = engine(x)
        if not token_mean:
            loss = loss_fn(out, y)
        elif weights[count]:  # the mean over its kept labels, times kept * gas * dp / count
            loss = loss_fn(out, y) * weights[count]
        else:  # no label trains here: a zero loss that still runs backward (ZeRO, TP)
            loss = out.float().sum() * 0.0
        if loss_factor != 1.0:
            loss = loss * loss_factor
        engine.backward(loss)
        total += loss.detach().float()
        if engine.is_gradient_accumulation_boundary():
            mean, nonfinite = _agree(total, count + 1, dp, groups)
            if judge is not None:
                judge(mean, nonfinite)
        engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
    return mean


def _agree(total: torch.Tensor, count: int, dp: int, groups: RankGroups) -> tuple[float, bool]:
    """Collective over the world, once a step: the global-batch mean loss from this rank's
    loss sum over `count` micro-batches, and whether any rank's was not finite."""
    box = torch.stack([total / count if groups.tp_rank == 0 else torch.zeros_like(total),
                       (~torch.isfinite(total)).float()])
    if dist.get_world_size() > 1:
        dist.all_reduce(box)
    mean, bad = box.tolist()  # the step's one transfer to the host
    return mean / dp, bad > 0


def _read_span(read: list[int], groups: RankGroups, device: torch.device
               ) -> tuple[int | None, int]:
    """Collective over the DP group: the first global sample number its replicas' loaders
    returned this step and how many they returned in all (None, 0: this pipeline stage reads
    no data). A replica reads a contiguous slice, the replicas one after the other: the step
    read [first, first + count), as the step report says."""
    dp = groups.dims.dp
    box = torch.zeros((dp, 2), dtype=torch.int64, device=device)
    if read:
        box[groups.dp_rank] = torch.tensor([min(read) + 1, len(read)], dtype=torch.int64)
    if dp > 1:
        dist.all_reduce(box, group=groups.dp)
    rows = box.tolist()
    firsts = [f - 1 for f, n in rows if n]
    return (min(firsts) if firsts else None), sum(n for _, n in rows)


def _grad_norm(engine) -> float | None:
    """The engine's global gradient norm of the last step, before clipping, as a float."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def _to(batches, device: torch.device):
    return data.to_device(batches, device)


def _check_row(row: RankPlan, groups: RankGroups) -> None:
    """The rank's row of the plan puts it where its process groups do."""
    assert (row.rank, row.pp, row.dp, row.tp) == (
        groups.rank, groups.pp_rank, groups.dp_rank, groups.tp_rank), (
        f"rank {groups.rank}'s row of the plan is rank {row.rank}'s (pp {row.pp}, dp {row.dp},"
        f" tp {row.tp})")


def _check_stage(module: torch.nn.Module, row: RankPlan) -> None:
    """The blocks this rank built are its row's layer ranges, in order."""
    built = [m.index for m in module.modules() if isinstance(m, Block)]
    assert built == row.blocks, f"rank {row.rank} built blocks {built}, the plan says {row.blocks}"


# --- custom entrypoints -------------------------------------------------------------------------

def _run_entrypoint(spec: JobSpec, ctx: RankContext, s: RankSession, report: Report,
                    stop: threading.Event) -> None:
    assert spec.entrypoint is not None
    module_name, func_name = spec.entrypoint.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    resume = checkpoint.agreed_resume(ctx.checkpoint_dir)
    unsaid = list(resume.skipped)  # the damaged tags passed over go with its first report

    def first_says(r: StepReport | dict[str, Any]) -> None:
        step = StepReport.model_validate(r)
        if unsaid:
            step = step.model_copy(update={"resume_skipped": unsaid[:]})
            unsaid.clear()
        report(step)

    func(TrainContext(spec=spec, rank=ctx.rank, world_size=ctx.world_size,
                      local_rank=ctx.local_rank, device=s.device, groups=s.groups,
                      ds_config=s.ds_config, checkpoint_dir=ctx.checkpoint_dir,
                      report=first_says, resume_step=resume.step, stop=stop, plan=ctx.plan,
                      attempt=ctx.attempt, data=s.source, save_steps=steps_writer(ctx)))


# --- torchrun entry point -----------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    from service.contract.specfile import load_yaml

    parser = argparse.ArgumentParser(description="Run one rank of a Trident job (torchrun).")
    parser.add_argument("--spec", required=True, help="job spec, YAML or JSON")
    parser.add_argument("--checkpoint-dir", default=None, help="overrides checkpoint.dir")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = JobSpec.model_validate(load_yaml(f))
    env = os.environ
    rank = int(env.get("RANK", 0))
    ctx = RankContext(rank=rank, world_size=int(env.get("WORLD_SIZE", 1)),
                      local_rank=int(env.get("LOCAL_RANK", 0)), plan=planned_row(spec, rank),
                      master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                      master_port=int(env.get("MASTER_PORT", 29500)),
                      checkpoint_dir=args.checkpoint_dir or spec.checkpoint.dir,
                      attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))

    def report(r: StepReport) -> None:
        if ctx.rank == 0:
            print(r.model_dump_json(), flush=True)

    train_rank(spec, ctx, report, threading.Event())


if __name__ == "__main__":
    main()
