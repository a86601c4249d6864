"""The per-rank trainer: what one rank of a job runs, for every TP x PP x DP x ZeRO layout.

Two callers: the Ray actor of `workers.group` calls `train_rank` on a thread (one actor per
rank, rendezvous given in `RankContext`), and `python -m workers.train --spec SPEC.yaml` runs
the same function under torchrun (rendezvous read from torchrun's environment), for debugging
and as the baseline without orchestration.

`train_rank` reads top to bottom: set up torch.distributed and the TP/PP/DP groups, build the
model (each weight drawn unsharded from the seed, then sliced: layout-invariant), parallelize
(tensor parallel inside the layers, then activation checkpointing inside the blocks, then ZeRO
wrapping last through `deepspeed.initialize`), resume, loop (report every optimizer step, save
every `checkpoint.every_steps`: a save that fails is reported and the loop goes on), tear down.
A spec with `entrypoint` runs that function instead of the built-in GPT loop, between the same
set-up and tear-down.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.constants import default_pg_timeout

from service.checkpoints import CheckpointWriter
from service.parallel import rank_layout
from service.planner.shape import ModelShape
from service.protocols import MemoryReport, StepReport
from service.spec import JobSpec, ParallelSpec
from workers import checkpoint, data, memory, rendezvous
from workers.bubble import BubbleMeter
from workers.model import GPT, Block, loss_fn
from workers.tp import DeepSpeedMpu, RankGroups, build_groups, dp_all_reduce, world_any

Report = Callable[[StepReport], None]
"""Called once per optimizer step on every rank with a `service.protocols.StepReport`."""

CustomReport = Callable[[StepReport | dict[str, Any]], None]
"""A custom entrypoint's `TrainContext.report`: a `StepReport`, or a dict validated into one
(values beyond its fields go in its `custom` dict)."""


@dataclass
class RankContext:
    """Where this rank sits and how to reach the others (given by the worker group)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    checkpoint_dir: str | None
    """The job's checkpoint directory (None: no checkpoints)."""
    attempt: int = 0
    writer: CheckpointWriter | None = None
    """The job `checkpoint_dir` must belong to, checked before any rank resumes (None: not
    checked, as under torchrun)."""


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
    attempt: int = 0
    layout: list[dict[str, object]] = field(default_factory=list)

    def should_stop(self) -> bool:
        """Collective: whether any rank was asked to stop; call it on every rank each step."""
        return world_any(self.stop.is_set(), self.device)


def train_rank(spec: JobSpec, ctx: RankContext, report: Report, stop: threading.Event) -> None:
    """Set up torch.distributed, build the model, train spec.train.steps steps, report, tear
    down. Exceptions propagate; `stop` ends the run cleanly between steps."""
    device = _setup(spec, ctx)
    try:
        checkpoint.claim_folder(ctx.checkpoint_dir, ctx.writer)  # before any rank reads it
        layout = spec.layout
        groups = build_groups(layout.dims, ctx.rank)
        ds_config = deepspeed_config(spec, device)
        if spec.entrypoint:
            _run_entrypoint(spec, ctx, device, groups, ds_config, report, stop)
        else:
            _train_gpt(spec, ctx, device, groups, ds_config, report, stop)
    except BaseException:
        _teardown(wait_for_peers=False)  # peers may be gone: a barrier would hide the error
        raise
    _teardown(wait_for_peers=True)


# --- set up and tear down -----------------------------------------------------------------------

def _setup(spec: JobSpec, ctx: RankContext) -> torch.device:
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
    # The group first, on the job's master address (workers.rendezvous); DeepSpeed then finds
    # it initialised. Its timeout and device binding are what DeepSpeed would have used.
    rendezvous.init_process_group(
        "nccl" if use_gpu else "gloo", rank=ctx.rank, world_size=ctx.world_size,
        master_addr=ctx.master_addr, port=ctx.master_port, timeout=default_pg_timeout,
        device_id=torch.device("cuda", gpu) if use_gpu and ctx.world_size > 1 else None)
    deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo",
                               auto_mpi_discovery=False, verbose=False,
                               rank=ctx.rank, world_size=ctx.world_size)
    torch.manual_seed(spec.train.seed)
    return torch.device("cuda", gpu) if use_gpu else torch.device("cpu")


def _teardown(wait_for_peers: bool) -> None:
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
    """The DeepSpeed config of this layout: batch sizes, AdamW, precision, ZeRO over DP.

    AdamW is torch's own, except with CPU offload on a GPU, where DeepSpeed's vectorised
    DeepSpeedCPUAdam steps the offloaded states (on a CPU-only rank the states live in CPU
    memory anyway, and torch's AdamW needs no compiled op).
    """
    p, t = spec.layout, spec.train
    torch_adam = not (device is not None and device.type == "cuda" and p.offload != "none")
    zero: dict[str, Any] = {"stage": p.zero}
    if p.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu"}
    if p.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.global_batch // (t.micro_batch * p.dp),
        "optimizer": {"type": "AdamW",
                      "params": {"lr": t.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                 "weight_decay": 0.0, "torch_adam": torch_adam}},
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "initial_scale_power": 12},
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # The pipeline engine may send 1/tp of each activation and all-gather it on receipt,
        # which assumes activations replicated over TP; with sequence parallelism they are not.
        "pipeline": {"pipe_partitioned": not p.sequence_parallel,
                     "grad_partitioned": not p.sequence_parallel},
    }


# --- the built-in GPT trainer -------------------------------------------------------------------

def _train_gpt(spec: JobSpec, ctx: RankContext, device: torch.device, groups: RankGroups,
               ds_config: dict[str, Any], report: Report, stop: threading.Event) -> None:
    layout, t = spec.layout, spec.train
    shape = ModelShape.from_spec(spec.model)  # what the planner counted; built as it is
    _check_layout(layout, shape, groups, ctx.rank)

    # Build and parallelize: tensor parallel and activation checkpointing live inside the
    # layers (workers.model); ZeRO wraps last, in deepspeed.initialize, over the DP group.
    # The pipeline's waits for neighbouring stages (none without a pipeline: a bubble of 0).
    bubble = BubbleMeter(cuda=device.type == "cuda",
                         sample_every=spec.monitor.comm_sample_every) if layout.pp > 1 else None
    if layout.pp > 1 and layout.virtual_stages > 1:
        # DeepSpeed has no interleaved schedule: torch.distributed.pipelining (see module).
        from workers.interleaved import InterleavedEngine
        engine = InterleavedEngine(spec, shape, groups, device, bubble)
    elif layout.pp > 1:
        from workers.pipeline import build_pipeline
        model = build_pipeline(shape, t.seed, layout.dims, groups, layout.recompute,
                               layout.sequence_parallel, layout.partition)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config)
        assert bubble is not None
        bubble.attach_deepspeed(engine)
    else:
        model = GPT(shape, t.seed, groups, layout.recompute, layout.sequence_parallel).to(device)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config, mpu=DeepSpeedMpu(groups))
    _check_stage(engine.module, layout, shape, ctx.rank)

    states: dict[str, int] = {}
    inner = memory.innermost_optimizer(engine.optimizer)
    inner.register_step_post_hook(
        lambda *_: states.update(memory.model_state_bytes(engine.module, engine.optimizer)))
    acts = memory.ActivationMeter(engine.module)

    start = 0
    if ctx.checkpoint_dir:
        resume = checkpoint.agreed_resume_step(ctx.checkpoint_dir)
        if resume:
            start = checkpoint.load(engine, ctx.checkpoint_dir, resume)

    tokens_per_step = t.global_batch * shape.seq_len
    for step in range(start, t.steps):
        # Every rank stops at the same step boundary, even when `stop` reached some ranks a
        # step later than others: a rank that left alone would leave its peers in a collective.
        if world_any(stop.is_set(), device):
            break
        if bubble is not None:
            bubble.begin_step(step + 1)
        t0 = time.perf_counter()
        batches = data.micro_batches(seed=t.seed, step=step, dp_rank=groups.dp_rank,
                                     dp=layout.dp, global_batch=t.global_batch,
                                     micro_batch=t.micro_batch, seq_len=shape.seq_len,
                                     vocab=shape.vocab)
        with acts.track():
            if layout.pp > 1:
                loss = float(engine.train_batch(data_iter=_to(batches, device)))
            else:
                loss = _train_step(engine, _to(batches, device), groups, layout.dp)
        dt = time.perf_counter() - t0
        waited = bubble.end_step() if bubble is not None else 0.0
        saved = checkpoint.Saved(None, None)
        if ctx.checkpoint_dir and spec.checkpoint.every_steps and \
                (step + 1) % spec.checkpoint.every_steps == 0:
            # A save the disk refuses is reported with the step; training goes on.
            saved = checkpoint.save(engine, ctx.checkpoint_dir, step + 1)
        report(StepReport(
            rank=ctx.rank, step=step + 1, loss=loss,
            step_time_s=dt, tokens_per_s=tokens_per_step / dt,
            bubble_s=None if waited is None else min(waited, dt),
            tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, dp_rank=groups.dp_rank,
            attempt=ctx.attempt, resumed_from=start, checkpoint=saved.path,
            checkpoint_error=saved.error,
            memory=MemoryReport(
                params_bytes=states.get("params", 0),
                grads_bytes=states.get("grads", 0),
                optimizer_bytes=states.get("optimizer", 0),
                activations_peak_bytes=acts.peak,
                process_peak_bytes=memory.process_peak_bytes(device),
                process_peak_source="cuda_max_allocated" if device.type == "cuda"
                else "rss_peak")))
    engine.destroy()


def _train_step(engine, batches, groups: RankGroups, dp: int) -> float:
    """One optimizer step of a single-stage engine: accumulate micro-batches, step, and return
    the global-batch mean loss (mean over micro-batches, then over DP replicas)."""
    total = torch.zeros((), dtype=torch.float32)
    count = 0
    for x, y in batches:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
        total += loss.detach().float().cpu()
        count += 1
    total /= count
    if dp > 1:
        device_total = total.to(engine.device)
        dp_all_reduce(device_total, groups.dp)
        total = device_total.cpu() / dp
    return float(total)


def _to(batches, device: torch.device):
    for x, y in batches:
        yield x.to(device), y.to(device)


def _check_layout(layout: ParallelSpec, shape: ModelShape, groups: RankGroups,
                  rank: int) -> None:
    """The trainer runs exactly the stored plan's layout: same coordinates, same layer ranges."""
    if layout.sequence_parallel and shape.seq_len % layout.tp:
        raise ValueError(f"parallel.sequence_parallel: tp({layout.tp}) does not divide"
                         f" seq_len({shape.seq_len})")
    row = rank_layout(layout.dims, shape.layers, layout.virtual_stages,
                      _weights(layout, shape))[rank]
    assert (row["pp"], row["dp"], row["tp"]) == (groups.pp_rank, groups.dp_rank, groups.tp_rank)


def _weights(layout: ParallelSpec, shape: ModelShape) -> list[int] | None:
    """The `parameters` partition's weights, as the planner's rank layout uses them."""
    return shape.pipeline_weights() if layout.partition == "parameters" and layout.pp > 1 \
        else None


def _check_stage(module: torch.nn.Module, layout: ParallelSpec, shape: ModelShape,
                 rank: int) -> None:
    """The blocks this rank built are the plan's layer ranges for its stage, in order."""
    ranges = shape.stages(layout.pp, layout.virtual_stages, layout.partition)
    planned = [i for start, end in ranges[layout.dims.coord(rank).pp] for i in range(start, end)]
    built = [m.index for m in module.modules() if isinstance(m, Block)]
    assert built == planned, f"rank {rank} built blocks {built}, the plan says {planned}"


# --- custom entrypoints -------------------------------------------------------------------------

def _run_entrypoint(spec: JobSpec, ctx: RankContext, device: torch.device, groups: RankGroups,
                    ds_config: dict[str, Any], report: Report, stop: threading.Event) -> None:
    assert spec.entrypoint is not None
    module_name, func_name = spec.entrypoint.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    resume = checkpoint.agreed_resume_step(ctx.checkpoint_dir)
    func(TrainContext(spec=spec, rank=ctx.rank, world_size=ctx.world_size,
                      local_rank=ctx.local_rank, device=device, groups=groups,
                      ds_config=ds_config, checkpoint_dir=ctx.checkpoint_dir,
                      report=lambda r: report(StepReport.model_validate(r)),
                      resume_step=resume, stop=stop, attempt=ctx.attempt,
                      layout=rank_layout(spec.layout.dims, spec.model.layers,
                                         spec.layout.virtual_stages,
                                         _weights(spec.layout,
                                                  ModelShape.from_spec(spec.model)))))


# --- torchrun entry point -----------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    from service.specfile import load_yaml

    parser = argparse.ArgumentParser(description="Run one rank of a Trident job (torchrun).")
    parser.add_argument("--spec", required=True, help="job spec, YAML or JSON")
    parser.add_argument("--checkpoint-dir", default=None, help="overrides checkpoint.dir")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = JobSpec.model_validate(load_yaml(f))
    env = os.environ
    ctx = RankContext(rank=int(env.get("RANK", 0)), world_size=int(env.get("WORLD_SIZE", 1)),
                      local_rank=int(env.get("LOCAL_RANK", 0)),
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
