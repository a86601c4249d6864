"""Fast, single-process checks of the trainer's parts: data, layout-invariant initialisation,
the plan's stage boundaries, and the activation meter."""

from __future__ import annotations

import torch

from service.contract.parallel import ParallelDims, partition_balanced, stage_layers
from service.contract.spec import ModelSpec
from service.planner.shape import ModelShape
from workers.modeling.model import GPT, Block, parameter_count
from workers.modeling.tp import RankGroups
from workers.monitor.memory import ActivationMeter
from workers.trainer import data
from workers.trainer.pipeline import layer_parts

CFG = ModelShape.from_spec(ModelSpec(preset="gpt-tiny"))


def _groups(tp: int, tp_rank: int) -> RankGroups:
    # No process group: the layers only slice their weights, which is what is checked here.
    return RankGroups(dims=ParallelDims(tp=tp), rank=tp_rank, tp_rank=tp_rank, pp_rank=0,
                      dp_rank=0, tp=None, pp=None, dp=None)


def test_samples_depend_only_on_seed_and_index():
    a = data.sample(7, 123, 32, 256)
    assert torch.equal(a, data.sample(7, 123, 32, 256))
    assert not torch.equal(a, data.sample(7, 124, 32, 256))
    assert not torch.equal(a, data.sample(8, 123, 32, 256))
    assert a.shape == (33,) and int(a.max()) < 64  # a quarter of the vocabulary


def test_the_global_batch_is_the_same_however_it_is_split_over_dp_and_micro_batches():
    def global_batch(dp: int, micro: int) -> torch.Tensor:
        xs = [x for d in range(dp) for x, _ in data.micro_batches(
            seed=1, step=3, dp_rank=d, dp=dp, global_batch=8, micro_batch=micro,
            seq_len=32, vocab=256)]
        return torch.cat(xs)
    reference = global_batch(1, 8)
    assert torch.equal(reference, global_batch(2, 2))
    assert torch.equal(reference, global_batch(4, 1))
    assert not torch.equal(reference, torch.cat([x for x, _ in data.micro_batches(
        seed=1, step=4, dp_rank=0, dp=1, global_batch=8, micro_batch=8, seq_len=32, vocab=256)]))


def test_tensor_parallel_shards_are_slices_of_the_unsharded_weights():
    full = Block(2, CFG, 5, None)
    shards = [Block(2, CFG, 5, _groups(2, r)) for r in range(2)]
    for name in ("q", "k", "v", "up"):  # column parallel: output rows split
        cat = torch.cat([s.projection(name) for s in shards], dim=0)
        assert torch.equal(cat, full.projection(name)), name
    for name in ("o", "down"):  # row parallel: input columns split
        cat = torch.cat([s.projection(name) for s in shards], dim=1)
        assert torch.equal(cat, full.projection(name)), name
    assert shards[0].projection("q").shape == (CFG.hidden // 2, CFG.hidden)


def test_a_tp_rank_fused_weight_is_its_own_rows_of_each_projection_stacked():
    """GQA, SwiGLU, q/k/v biases: on TP rank r, qkv is [q_r; k_r; v_r] and gate_up [gate_r; up_r],
    the rows of the tp = 1 fused weight that are rank r's of each projection."""
    shape = ModelShape.from_spec(ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2,
                                           vocab=128, seq_len=16, activation="swiglu",
                                           qkv_bias=True))
    whole = Block(1, shape, 3, None)
    q, kv, f = shape.q_dim, shape.kv_dim, shape.ffn_hidden
    for fused, sizes in (("qkv", (q, kv, kv)), ("gate_up", (f, f))):
        parts = getattr(whole, fused).weight.split(sizes)
        for r in range(2):
            shard = getattr(Block(1, shape, 3, _groups(2, r)), fused)
            mine = torch.cat([p.chunk(2)[r] for p in parts])
            assert torch.equal(shard.weight, mine), (fused, r)
            # Biases on q, k and v only (Qwen2's): zeros, split with the rows.
            assert (shard.bias is not None) == (fused == "qkv"), fused
            if shard.bias is not None:
                assert shard.bias.shape == (sum(sizes) // 2,), fused


def test_the_trainer_builds_exactly_the_parameters_the_planner_counts():
    llama_like = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=16,
                           activation="swiglu")  # no preset: RMSNorm, rotary, untied
    gpt_like = ModelSpec(layers=2, hidden=64, heads=4, vocab=128, seq_len=16)  # biases, tied
    qwen2_like = llama_like.model_copy(update={"qkv_bias": True})  # biases on q, k, v only
    for spec in (ModelSpec(preset="gpt-tiny"), qwen2_like,
                 ModelSpec(preset="gpt-tiny", activation="swiglu", kv_heads=2, ffn_hidden=96),
                 llama_like, gpt_like, ModelSpec(preset="gpt3-125m", layers=1, seq_len=64)):
        shape = ModelShape.from_spec(spec)
        model = GPT(shape, 0)
        assert sum(p.numel() for p in model.parameters()) == shape.total_params, spec
        assert parameter_count(shape) == shape.total_params
        for r in (0, 1):  # an odd vocabulary gives TP rank 0 one row more
            half = sum(p.numel() for p in GPT(shape, 0, _groups(2, r)).parameters())
            assert half == shape.rank_params(2, shape.layers, True, True, tp_rank=r)
        assert parameter_count(shape, tp=2) == shape.rank_params(2, shape.layers, True, True)
    assert ModelShape.from_spec(ModelSpec(preset="gpt-tiny")).total_params == 232_576


def test_the_trainer_refuses_a_shape_it_would_build_differently_naming_the_trait():
    import dataclasses

    import pytest

    from workers.modeling.model import check_buildable

    gpt = ModelShape.from_spec(ModelSpec(layers=2, hidden=64, heads=4, vocab=128, seq_len=16))
    check_buildable(gpt)  # GPT style: biases, tied head, learned positions
    check_buildable(ModelShape.from_spec(ModelSpec(preset="gpt3-125m")))
    with pytest.raises(ValueError, match=r"not 'alibi'"):
        check_buildable(dataclasses.replace(CFG, positions="alibi"))
    with pytest.raises(ValueError, match=r"even head size"):
        check_buildable(ModelShape.from_spec(ModelSpec(
            layers=1, hidden=12, heads=4, vocab=16, seq_len=8, activation="swiglu")))


def test_rotary_positions_make_attention_scores_depend_on_the_offset_only():
    from workers.modeling.positions import rotary

    q, k = torch.randn(1, 1, 1, 8).expand(1, 1, 6, 8), torch.randn(1, 1, 1, 8).expand(1, 1, 6, 8)
    scores = rotary(q) @ rotary(k).transpose(-1, -2)  # the same q and k at every position
    for offset in range(-5, 6):
        diagonal = torch.diagonal(scores[0, 0], offset)
        assert torch.allclose(diagonal, diagonal[0].expand_as(diagonal), atol=1e-5), offset
    assert torch.allclose(rotary(q).norm(dim=-1), q.norm(dim=-1), atol=1e-5)


def test_rotary_is_bit_for_bit_the_explicit_pairs_forward_and_backward():
    from workers.modeling.positions import rotary

    def pairs(x: torch.Tensor, base: float) -> torch.Tensor:  # the rotation written out
        s, d = x.shape[-2], x.shape[-1]
        inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        angle = torch.outer(torch.arange(s, dtype=torch.float32), inv)
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for base in (10000.0, 500000.0):
            x = torch.randn(2, 3, 11, 16, generator=gen).to(dtype).requires_grad_()
            g = torch.randn(2, 3, 11, 16, generator=gen).to(dtype)
            want = pairs(x, base)
            got = rotary(x, base)
            assert torch.equal(got, want), (dtype, base)
            assert torch.equal(torch.autograd.grad(got, x, g)[0],
                               torch.autograd.grad(want, x, g)[0]), (dtype, base)


def test_gpt_with_gqa_and_swiglu_runs_forward_and_backward():
    for spec in (ModelSpec(preset="gpt-tiny", activation="swiglu", kv_heads=2),
                 ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=16,
                           activation="swiglu")):  # Llama-like: RMSNorm, rotary
        shape = ModelShape.from_spec(spec)
        model = GPT(shape, 0)
        x, y = data.batch(0, 0, 2, shape.seq_len, shape.vocab)
        logits = model(x)
        assert logits.shape == (2, shape.seq_len, shape.vocab)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        assert all(p.grad is not None for p in model.parameters())


def test_stage_boundaries_are_the_plans_with_embedding_first_and_head_last():
    # layer list: [embedding, block 0..7, head]; pp 2 -> blocks 0-3 and 4-7
    assert layer_parts(stage_layers(8, 2), 8) == [0, 5, 10]
    assert layer_parts(stage_layers(4, 4), 4) == [0, 2, 3, 4, 6]
    # uneven: 5 blocks on 2 stages, the first takes the extra one (DeepSpeed's uniform)
    assert layer_parts(stage_layers(5, 2), 5) == [0, 4, 7]


def test_activation_meter_counts_saved_activations_and_less_with_full_recompute():
    x, _ = data.batch(0, 0, 2, CFG.seq_len, CFG.vocab)
    peaks = {}
    for recompute in ("none", "selective", "full"):
        model = GPT(CFG, 0, recompute=recompute)
        meter = ActivationMeter(model)
        with meter.track():
            model(x).float().mean().backward()
        assert meter.live == {"activations": 0, "logits": 0}, \
            "every saved tensor is released after backward"
        peaks[recompute] = meter.peak
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks
    # Full recompute keeps about one hidden-state tensor per block plus embedding and head.
    assert peaks["full"] < peaks["none"] / 3


def test_activation_meter_releases_a_graph_dropped_without_backward():
    """A forward whose graph is dropped unused (torch's pipelining runs one to infer its stages'
    shapes) releases its saved activations at once: the meter's records hold no reference
    cycle through the ops that save their own outputs (attention, norms), which only a full
    garbage collection would free."""
    import gc

    x, _ = data.batch(0, 0, 2, CFG.seq_len, CFG.vocab)
    model = GPT(CFG, 0, recompute="none")
    meter = ActivationMeter(model)
    gc.disable()
    try:
        with meter.track():
            out = model(x)
        assert meter.live["activations"] > 0
        del out
        assert meter.live == {"activations": 0, "logits": 0}
    finally:
        gc.enable()


def test_interleaved_stages_refuse_what_their_torch_path_cannot_do_with_the_reason():
    import pytest

    from service.contract.spec import JobSpec
    from workers.trainer.interleaved import check_supported

    ok = JobSpec(name="v", model={"preset": "gpt-tiny"},
                 parallel={"pp": 2, "virtual_stages": 2, "dp": 2, "zero": 1},
                 train={"precision": "fp32", "global_batch": 8, "micro_batch": 2})
    check_supported(ok)
    check_supported(ok.model_copy(update={"train": ok.train.model_copy(
        update={"precision": "bf16"})}))  # fp32 masters of its own (see the module)
    fp16 = ok.model_copy(update={"train": ok.train.model_copy(update={"precision": "fp16"})})
    with pytest.raises(NotImplementedError, match=r"fp32 or bf16; got .*precision='fp16'"):
        check_supported(fp16)
    zero2 = ok.model_copy(update={"parallel": ok.parallel.model_copy(update={"zero": 2})})
    with pytest.raises(NotImplementedError, match=r"zero\(2\)"):
        check_supported(zero2)


def test_resume_picks_the_newest_checkpoint_that_every_rank_finished(tmp_path):
    from workers.checkpoint import saving as checkpoint
    assert checkpoint.newest_complete_step(str(tmp_path / "missing")) == 0
    assert checkpoint.newest_complete_step(None) == 0
    for step, complete in ((2, True), (4, True), (6, False), (10, False)):
        (tmp_path / f"step{step}").mkdir()
        if complete:
            (tmp_path / f"step{step}" / checkpoint.MARKER).write_text(f"{step}\n")
    (tmp_path / "latest").write_text("step10")  # DeepSpeed's own pointer is not trusted
    assert checkpoint.newest_complete_step(str(tmp_path)) == 4



def test_parameters_partition_is_deepspeeds_own_balance():
    # The planner's copy of DeepSpeed's linear-partition dynamic programme must choose the
    # boundaries DeepSpeed's PipelineModule(partition_method='parameters') would choose.
    from deepspeed.runtime.utils import partition_balanced as ds_balanced

    shape = ModelShape.from_spec(ModelSpec(preset="gpt-tiny", layers=7))
    weights = shape.pipeline_weights()
    for parts in (2, 3, 4):
        assert partition_balanced(tuple(map(float, weights)), parts) == \
            ds_balanced(weights, parts)
    for weights, parts in (([5, 1, 1, 1, 1, 1, 1, 5], 3), ([1, 2, 3, 4, 5, 6], 4),
                           ([3, 3, 3, 3, 3], 2)):
        assert partition_balanced(tuple(map(float, weights)), parts) == \
            ds_balanced(weights, parts)
    # The heavy embedding and head push blocks towards the middle stages.
    stages = shape.stages(3, 1, "parameters")
    assert [b - a for (a, b), in stages][1] >= max(b - a for (a, b), in stages)


def test_each_rank_builds_the_parameters_the_plan_counts_for_its_stage_under_tp_and_pp():
    # The plan's per-stage parameter bytes (fp32, ZeRO-0: 4 bytes per parameter held) are
    # what every TP rank of that stage builds, embedding and vocabulary-split head included.
    from service.contract.spec import JobSpec
    from service.planner import evaluate
    from service.planner.stored import plan_json
    from workers.modeling.model import build_layers

    for model in ({"preset": "gpt-tiny"},
                  {"layers": 4, "hidden": 64, "heads": 8, "kv_heads": 4, "vocab": 202,
                   "seq_len": 16, "activation": "swiglu"},
                  {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32}):
        for tp in (1, 2, 4):
            for pp in (1, 2):
                spec = JobSpec(name="count", model=model, parallel={"tp": tp, "pp": pp},
                               train={"precision": "fp32", "global_batch": 8})
                shape = ModelShape.from_spec(spec.model)
                plan = plan_json(evaluate(spec))
                for stage, mem in enumerate(plan["memory_by_stage"]):
                    (rng,) = mem["layers"]
                    for r in range(tp):
                        built = sum(p.numel() for layer in build_layers(
                            shape, 0, _groups(tp, r), layer_range=tuple(rng)) for p in
                            layer.parameters())
                        largest = shape.rank_params(tp, rng[1] - rng[0], first=stage == 0,
                                                    last=stage == pp - 1, pp=pp, tp_rank=r)
                        assert built == largest, (model, tp, pp, stage, r)
                        if shape.vocab % tp == 0 or r == 0:
                            assert 4 * built == mem["params"], (model, tp, pp, stage, r)


def test_a_ranks_program_is_resolved_from_its_spec_and_imported_only_when_it_runs():
    """The rank actor and the program seam load neither torch nor the trainer: a job's program
    (its `command`; under `program: light` the light program or its entrypoint in it, else its
    entrypoint, else the built-in trainer) is looked up by its spec, and its module is
    imported when a rank runs it; every registered program names a function that exists."""
    import importlib
    import json
    import subprocess
    import sys

    from tests.conftest import tiny_spec
    from workers.runtime import programs
    code = f"""
import json, sys
from service.contract.spec import JobSpec
import workers.rank.actor
from workers.runtime.programs import for_spec
plain = JobSpec.model_validate(json.loads({json.dumps(tiny_spec())!r}))
custom = plain.model_copy(update={{"entrypoint": "tests.entrypoints:explode"}})
light = plain.model_copy(update={{"program": "light"}})
light_custom = custom.model_copy(update={{"program": "light"}})
command = plain.model_copy(update={{"command": ["python", "train.py"], "workdir": "/code"}})
print(json.dumps([for_spec(plain).name, for_spec(custom).name, for_spec(light).name,
                  for_spec(light_custom).name, for_spec(command).name,
                  sorted(m for m in ("torch", "deepspeed", "workers.trainer.train")
                         if m in sys.modules)]))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert json.loads(out.splitlines()[-1]) == ["trainer", "entrypoint", "light",
                                                "light-entrypoint", "command", []]
    assert set(programs.PROGRAMS) == {"trainer", "entrypoint", "cluster-probe", "light",
                                      "light-entrypoint", "command"}
    assert programs.PROGRAMS["trainer"].marks_steps and programs.PROGRAMS["light"].marks_steps
    assert not programs.PROGRAMS["entrypoint"].marks_steps
    assert [p.name for p in programs.PROGRAMS.values() if not p.torch] == [
        "light", "light-entrypoint", "command"]
    for program in programs.PROGRAMS.values():
        module, function = program.target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), program.name
