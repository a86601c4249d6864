"""Test helper: a custom entrypoint that builds the job's engine with the built-in trainer's
`build_engine` and writes the whole vocabulary's logits of the job's first micro-batch as its
data source gives it ((tokens, documents) with `data.document_mask`).

With pp = 1 the engine's module runs the micro-batch; with a pipeline, DeepSpeed's pipeline
engine does (`eval_batch(..., return_logits=True)`): the documents travel between the stages
as the engine passes them. `TRIDENT_TEST_OUT` is the folder of `logits.pt`, written by the rank
on the last stage with TP and DP rank 0. Used by tests/test_document_masks.py."""

from __future__ import annotations

import os

import torch

from service.planner.shape import ModelShape
from workers.modeling.model import full_logits
from workers.trainer.data import to_device
from workers.trainer.train import build_engine


def logits(ctx) -> None:
    spec, groups, p = ctx.spec, ctx.groups, ctx.spec.layout
    shape = ModelShape.from_spec(spec.model)
    engine = build_engine(spec, shape, ctx.plan, ctx.device, groups, ctx.ds_config)
    assert ctx.data is not None
    batches = list(to_device(ctx.data.micro_batches(0), ctx.device))
    assert len(batches) == 1
    out = None
    if p.pp == 1:
        engine.module.eval()
        with torch.no_grad():
            out = engine.module(batches[0][0])
    else:
        _, out = engine.eval_batch(iter(batches), return_logits=True, num_micro_batches=1)
    if groups.pp_rank == p.pp - 1:
        out = full_logits(out, groups)
        if groups.tp_rank == 0 and groups.dp_rank == 0:
            torch.save(out, os.path.join(os.environ["TRIDENT_TEST_OUT"], "logits.pt"))
    engine.destroy()
