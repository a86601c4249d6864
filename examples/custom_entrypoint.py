"""A custom per-rank training function, run by a spec with
`entrypoint: "examples.custom_entrypoint:train"` instead of the built-in GPT trainer.

It receives `workers.trainer.train.TrainContext` on every rank after torch.distributed and the TP/PP/DP
groups are set up: here it fits a linear regression data-parallel over `ctx.groups.dp`, through
DeepSpeed with the job's own config (ZeRO stage, batch sizes), reporting every step and
checkpointing like the built-in trainer. The group tears down after it returns.
"""

from __future__ import annotations

import time

import deepspeed
import torch

from workers.modeling.tp import DeepSpeedMpu
from workers.trainer.train import TrainContext


def train(ctx: TrainContext) -> None:
    torch.manual_seed(ctx.spec.train.seed)  # same initial weights on every rank
    model = torch.nn.Linear(8, 1)
    config = dict(ctx.ds_config)
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.05, "torch_adam": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config, mpu=DeepSpeedMpu(ctx.groups))
    true_w = torch.arange(8, dtype=torch.float32)
    micro = ctx.spec.train.micro_batch
    for step in range(ctx.resume_step, ctx.spec.train.steps):
        if ctx.should_stop():
            break
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(step * 1000 + ctx.groups.dp_rank)
        losses = []
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randn(micro, 8, generator=gen)
            loss = torch.nn.functional.mse_loss(engine(x).squeeze(-1), x @ true_w)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        # A dict validated into a `service.contract.reports.StepReport`; values of our own go in
        # `custom` (a `StepReport(...)` works too).
        ctx.report({"rank": ctx.rank, "step": step + 1, "loss": sum(losses) / len(losses),
                    "step_time_s": time.perf_counter() - t0, "tokens_per_s": 0.0,
                    "dp_rank": ctx.groups.dp_rank,
                    "custom": {"world_size": ctx.world_size,
                               "zero": config["zero_optimization"]["stage"]}})
    engine.destroy()
