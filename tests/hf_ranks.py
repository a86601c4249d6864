"""Test helper: custom entrypoints that build the job's engine with the built-in trainer's
`build_engine` (shard-only construction, `init.from_hf`, `deepspeed.initialize`), optionally
restore a checkpoint tag, and write the whole vocabulary's logits of fixed tokens.

`families` does it for several Hugging Face folders in one group of ranks, one after the
other (`TRIDENT_TEST_FOLDERS`: a JSON list of folders, each read as `model.hf_config` and
`init.from_hf` over the job's own spec): each folder's logits go to `<folder>-logits.pt` and
its model is saved as checkpoint tag 1 under `<folder>-ckpt` (the layout's own tag, for
`trident export`).

Driven by the spec's `env`: `TRIDENT_TEST_OUT` the folder the logits go to (`logits.pt`, by
the rank on the last stage with TP and DP rank 0; and `full.pt`, every full tensor as
`workers.checkpoint.full_state.gather_full` joins them on rank 0), `TRIDENT_TEST_STEP` a tag to
load from
the job's checkpoint folder first. Used by tests/test_hf_models.py through `run_ranks`."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from service.contract import hf_config
from service.contract.parallel import Dim
from service.contract.spec import JobSpec
from service.planner.shape import ModelShape
from workers.checkpoint import saving as checkpoint
from workers.checkpoint.full_state import gather_full
from workers.modeling.model import full_logits
from workers.trainer.train import build_engine, planned_row

TOKENS_SEED = 7


def tokens(vocab: int, seq_len: int) -> torch.Tensor:
    """The fixed batch whose logits are compared."""
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(
        TOKENS_SEED))


def logits(ctx) -> None:
    spec, groups = ctx.spec, ctx.groups
    shape = ModelShape.from_spec(spec.model)
    # The trainer's own build: shard-only construction, `init.from_hf`, deepspeed.initialize
    engine = build_engine(spec, shape, ctx.plan, ctx.device, groups, ctx.ds_config)
    if step := os.environ.get("TRIDENT_TEST_STEP"):
        checkpoint.load(engine, ctx.checkpoint_dir, int(step), spec)
    _write_logits(engine, spec, shape, groups,
                  os.path.join(os.environ["TRIDENT_TEST_OUT"], "logits.pt"))
    full = gather_full(engine.module, groups)  # collective: every rank
    if groups.rank == 0:
        torch.save(full, os.path.join(os.environ["TRIDENT_TEST_OUT"], "full.pt"))
    engine.destroy()


def families(ctx) -> None:
    groups = ctx.groups
    for folder in json.loads(os.environ["TRIDENT_TEST_FOLDERS"]):
        raw = ctx.spec.model_dump(mode="json")
        raw["model"] = {"hf_config": folder, "seq_len": ctx.spec.model.seq_len}
        raw["init"] = {"from_hf": folder}
        with hf_config.reading(hf_config.local_reader):
            spec = JobSpec.model_validate(raw)
        shape = ModelShape.from_spec(spec.model)
        engine = build_engine(spec, shape, planned_row(spec, groups.rank), ctx.device, groups,
                              ctx.ds_config)
        _write_logits(engine, spec, shape, groups, f"{folder}-logits.pt")
        checkpoint.save(engine, f"{folder}-ckpt", 1, spec)  # collective: every rank
        engine.destroy()


def _write_logits(engine, spec, shape: ModelShape, groups, path: str) -> None:
    """The whole vocabulary's logits of `tokens`, written to `path` by the last stage's
    TP and DP rank 0 (each stage runs its layers; activations go to the next by hand)."""
    p = spec.layout
    x = tokens(shape.vocab, shape.seq_len)
    module = engine.module
    module.eval()
    with torch.no_grad():
        if p.pp == 1:
            out = module(x)
        else:
            pp_ranks = p.dims.group_of(groups.rank, Dim.PP)
            h = x
            if groups.pp_rank > 0:
                h = torch.empty(x.shape[0], x.shape[1], shape.hidden,  # the job's precision
                                dtype=next(module.parameters()).dtype)
                dist.recv(h, src=pp_ranks[groups.pp_rank - 1])
            h = module(h)
            if groups.pp_rank < p.pp - 1:
                dist.send(h.contiguous(), dst=pp_ranks[groups.pp_rank + 1])
            out = h
        if groups.pp_rank == p.pp - 1:
            out = full_logits(out, groups)
            if groups.tp_rank == 0 and groups.dp_rank == 0:
                torch.save(out, path)
