"""Shard-only construction: what a rank allocates while it builds its stage, and the model
states it then reports.

- Every rank draws only its TP shard of each weight: no tensor larger than the largest
  parameter it keeps (or one seeded block of the draw) is ever allocated, and its parameters
  are the planner's count for its rank, for tp 1, 2, 4 and pp 1, 2.
- Under ZeRO-3 with dp 4, a rank building a model of more than 1 GB of fp32 weights and its
  engine stays within 1.3x of the plan's model-state bytes for that rank (measured: 1.1x to
  1.2x), its model build alone below the whole model (measured: under half of it).
- The reported gradient bytes count both AdamW parameter groups (decayed / not) under ZeRO.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from service.contract.parallel import ParallelDims
from service.contract.spec import JobSpec, ModelSpec
from service.planner import evaluate
from service.planner.shape import ModelShape
from service.planner.stored import plan_json
from tests.servers import free_port
from workers.modeling.model import Block, build_layers, init_weight, parameter_count
from workers.modeling.seeded_init import BLOCK
from workers.modeling.tp import RankGroups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _groups(tp: int, tp_rank: int) -> RankGroups:
    # No process group: the layers only draw their shards, which is what is checked here.
    return RankGroups(dims=ParallelDims(tp=tp), rank=tp_rank, tp_rank=tp_rank, pp_rank=0,
                      dp_rank=0, tp=None, pp=None, dp=None)


class _LargestAllocation(TorchDispatchMode):
    """Bytes of the largest storage any operation returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_each_rank_allocates_only_the_shards_it_keeps_and_the_plans_count_for_tp_and_pp():
    # An odd vocabulary (uneven vocabulary slices), GQA and SwiGLU; a GPT-style model
    # (biases, tied head, learned positions).
    # And a Qwen3-style one: its own head size (heads x head_dim != hidden), q/k norms
    # (whole on every TP rank), biases on the attention and MLP linears, a tied head.
    for model in ({"layers": 4, "hidden": 64, "heads": 8, "kv_heads": 4, "vocab": 2003,
                   "seq_len": 16, "activation": "swiglu"},
                  {"layers": 4, "hidden": 64, "heads": 4, "vocab": 2048, "seq_len": 32},
                  {"layers": 4, "hidden": 48, "heads": 8, "kv_heads": 4, "head_dim": 8,
                   "vocab": 1001, "seq_len": 16, "activation": "swiglu", "qk_norm": True,
                   "attention_bias": True, "mlp_bias": True, "tied": True}):
        for tp in (1, 2, 4):
            for pp in (1, 2):
                spec = JobSpec(name="count", model=model, parallel={"tp": tp, "pp": pp},
                               train={"precision": "fp32", "global_batch": 8})
                shape = ModelShape.from_spec(spec.model)
                plan = plan_json(evaluate(spec))
                for stage, mem in enumerate(plan["memory_by_stage"]):
                    (rng,) = mem["layers"]
                    for r in range(tp):
                        with _LargestAllocation() as seen:
                            layers = build_layers(shape, 0, _groups(tp, r),
                                                  layer_range=tuple(rng))
                        params = [p for layer in layers for p in layer.parameters()]
                        where = (model["vocab"], tp, pp, stage, r)
                        built = sum(p.numel() for p in params)
                        assert built == shape.rank_params(
                            tp, rng[1] - rng[0], first=stage == 0, last=stage == pp - 1,
                            pp=pp, tp_rank=r), where
                        if shape.vocab % tp == 0 or r == 0:  # the plan's is the largest rank
                            assert 4 * built == mem["params"], where
                        # Each parameter owns exactly its own bytes, and nothing larger than
                        # the largest of them (or one seeded block) was ever allocated.
                        assert all(p.untyped_storage().nbytes() == 4 * p.numel()
                                   for p in params), where
                        assert seen.largest <= 4 * max(BLOCK, *(p.numel() for p in params)), \
                            where


def test_shards_are_slices_of_the_whole_seeded_weights():
    shape = ModelShape.from_spec(ModelSpec(preset="gpt-tiny", kv_heads=2, ffn_hidden=96,
                                           activation="swiglu"))
    for name in ("q", "k", "v", "up", "gate"):  # column parallel: output rows
        rows = {"q": shape.hidden, "k": shape.kv_dim, "v": shape.kv_dim}.get(name, 96)
        whole = init_weight(0, 1, name, (rows, shape.hidden))
        shards = [Block(1, shape, 0, _groups(tp, r)).projection(name)
                  for tp in (2,) for r in range(tp)]
        assert torch.equal(torch.cat(shards), whole), name
    std = 0.02 / (2 * shape.layers) ** 0.5
    for name, cols in (("o", shape.hidden), ("down", 96)):  # row parallel: input columns
        whole = init_weight(0, 1, name, (shape.hidden, cols), std, transposed=True)
        for tp in (2, 4):
            shards = [Block(1, shape, 0, _groups(tp, r)).projection(name)
                      for r in range(tp)]
            assert torch.equal(torch.cat(shards, dim=1), whole), (name, tp)


def test_gradient_bytes_count_both_weight_decay_groups_under_zero():
    # AdamW with weight decay has two parameter groups; ZeRO steps its inner optimizer once
    # per group and frees each group's fp32 gradient partition after its call. The report
    # still counts the whole model's fp32 gradients (dp 1: the whole partition), as it does
    # with one group.
    from workers.trainer.train import RankContext, planned_row, train_rank

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    n = parameter_count(ModelShape.from_spec(ModelSpec(preset="gpt-tiny")))
    for weight_decay in (0.1, 0.0):
        spec = JobSpec(name="grads", model={"preset": "gpt-tiny"}, parallel={"zero": 1},
                       train={"steps": 1, "global_batch": 2, "micro_batch": 2,
                              "precision": "fp32", "weight_decay": weight_decay})
        rows: list = []
        ctx = RankContext(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                          master_port=free_port(), checkpoint_dir=None,
                          plan=planned_row(spec, 0))
        train_rank(spec, ctx, rows.append, threading.Event())
        (row,) = rows
        assert row.memory.grads_bytes == 4 * n, weight_decay
        assert row.memory.params_bytes == 4 * n


LARGE = {"layers": 8, "hidden": 1280, "heads": 10, "vocab": 32000, "seq_len": 64,
         "activation": "swiglu"}
"""292M parameters: 1.17 GB of fp32 weights."""


@pytest.mark.slow
def test_a_zero3_rank_builds_within_its_planned_model_states_not_the_whole_model():
    dp = 4
    spec = JobSpec(name="construct", model=LARGE, parallel={"dp": dp, "zero": 3},
                   train={"precision": "fp32", "global_batch": dp, "micro_batch": 1})
    shape = ModelShape.from_spec(spec.model)
    whole = 4 * shape.total_params
    assert whole >= 1e9
    mem = plan_json(evaluate(spec))["memory_by_stage"][0]
    model_states = mem["params"] + mem["grads"] + mem["optimizer"]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests",
                                                            "_construction_rank.py"),
                               spec.model_dump_json(), str(rank), str(dp), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT) for rank in range(dp)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for got in results:
        assert got["partition_params"] * dp >= shape.total_params  # ZeRO-3: a quarter each
        # Building the model and DeepSpeed's engine (its fp32 partitions and gradient
        # buffers; Adam's moments come at the first step): within the plan's model states.
        grown = got["peak"] - got["before"]
        assert grown <= 1.3 * model_states, (got, model_states)
        # The model itself never existed whole on the rank: its build held its quarter and
        # the module being partitioned (the 164 MB embedding at most), not the 1.17 GB.
        assert got["built_peak"] - got["before"] <= 0.75 * whole, (got, whole)
