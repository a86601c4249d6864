"""The stack-specific terms behind the held-out memory errors (docs/planner-model.md):
torchtitan's op-level selective checkpointing, the loss's buffers, models without dropout,
and DeepSpeed's BF16_Optimizer under the pipeline engine. Pure Python, well under a second.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.planner import ModelShape, sac
from service.planner.fit import leave_one_source_out
from service.planner.memory import layer_activation_bytes, model_state_bytes
from service.planner.published import load_data
from service.planner.software_stacks import get_stack, loss_bytes_per_logit, nccl_buffer_bytes

LLAMA3_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=128256,
                       seq_len=8192, ffn_hidden=14336, swiglu=True, biases=False,
                       layer_norm=False, positions="rotary", tied=False, dropout=False)


def test_op_level_policy_keeps_the_odd_matmuls_and_the_attention_output() -> None:
    """torchtitan's Llama block calls wq, wk, wv, wo, w1, w3, w2: the policy keeps the 1st,
    3rd, 5th and 7th mm (wq, wv, w1, w2), the attention output and its log-sum-exp, and the
    checkpoint holds the block input; it recomputes wk, wo and w3."""
    h, kv, f, a = 4096, 1024, 14336, 32
    kept = sac.saved_bytes_per_token(LLAMA3_8B, tp=1, sequence_parallel=False, act_bytes=2)
    assert kept == 2 * (h + h + kv + f + h + h) + 4 * a
    assert sac.recompute_flops_per_token(LLAMA3_8B, tp=1) == 2.0 * (kv * h + h * h + f * h)
    # About a third of what the block keeps without checkpointing.
    none = layer_activation_bytes(LLAMA3_8B, micro_batch=1, tp=1, sequence_parallel=False,
                                  recompute="none", flash=True) / LLAMA3_8B.seq_len
    assert 0.3 < kept / none < 0.4


def test_a_biased_block_keeps_no_matmul_output() -> None:
    """A linear with a bias is `aten.addmm`, neither saved nor counted as an mm."""
    gpt = replace(LLAMA3_8B, swiglu=False, biases=True, kv_heads=32, ffn_hidden=4 * 4096)
    kept = sac.saved_bytes_per_token(gpt, tp=1, sequence_parallel=False, act_bytes=2)
    assert kept == 2 * (4096 + 4096) + 4 * 32  # the block input and the attention output
    assert sac.recompute_flops_per_token(gpt, tp=1) == 2.0 * gpt.layer_matmul_params()


def test_only_the_fsdp_stack_runs_selective_as_the_op_level_policy() -> None:
    assert get_stack("fsdp").selective == "op"
    for name in ("trident", "megatron-lm", "megatron-deepspeed", "deepspeed"):
        assert get_stack(name).selective == "attention", name


def test_loss_bytes_per_logit() -> None:
    assert loss_bytes_per_logit("megatron", 2) == 6  # 16-bit logits + in-place fp32 softmax
    assert loss_bytes_per_logit("pytorch", 2) == 12  # log_softmax out, two fp32 gradients
    assert loss_bytes_per_logit("fused", 2) == 4  # 16-bit logits and their gradient


def test_dropout_free_blocks_keep_no_masks() -> None:
    with_dropout = replace(LLAMA3_8B, dropout=True)
    kw = {"micro_batch": 1, "tp": 1, "sequence_parallel": False, "recompute": "none",
          "flash": False}
    s, h, a = LLAMA3_8B.seq_len, LLAMA3_8B.hidden, LLAMA3_8B.heads
    diff = layer_activation_bytes(with_dropout, **kw) - layer_activation_bytes(LLAMA3_8B, **kw)
    assert diff == pytest.approx(s * h * (2 + 3 * a * s / h))  # two masks; score mask, output


def test_megatron_deepspeed_keeps_its_16_bit_gradients_next_to_the_fp32_ones() -> None:
    _, runs = load_data()
    bloom = next(r for r in runs if r.id == "BLOOM-176B")
    assert model_state_bytes(bloom.scenario()) == (2, 0, 6, 0, 12)


def test_megatron_deepspeed_in_fp16_runs_deepspeeds_zero_optimizer() -> None:
    """DeepSpeed picks BF16_Optimizer for bf16 weights only (engine.py,
    _do_optimizer_sanity_check); fp16 ZeRO-1 is its ZeRO optimizer, as the deepspeed stack."""
    _, runs = load_data()
    bloom = next(r for r in runs if r.id == "BLOOM-176B")
    fp16 = replace(bloom.scenario(), precision="fp16")
    assert model_state_bytes(fp16) == model_state_bytes(
        replace(fp16, stack="deepspeed", constants=get_stack("deepspeed", fitted=False)))
    assert model_state_bytes(fp16) != model_state_bytes(bloom.scenario())


def test_nccl_connects_each_peer_with_a_buffer_per_protocol() -> None:
    """Simple (NCCL_BUFFSIZE, 4 MiB), LL128 (4.7 MiB) and LL (0.5 MiB) per channel per peer
    (NCCL src/include/device.h); a ring has two peers, a pipeline pair one."""
    per = (4 << 20) + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
    assert nccl_buffer_bytes([8], 16) == 16 * 2 * per
    assert nccl_buffer_bytes([1, 2], 4) == 4 * per


def test_runs_published_as_trained_are_predicted_to_fit() -> None:
    """Every run published as trained fits its GPUs as nvidia-smi counts them (MPT-3b on 64
    A100-40GB, micro-batch 6 and no recompute, is the closest: 38.1 GiB of 40 GiB)."""
    table, _ = leave_one_source_out()
    misses = [r.run.id for s in table for r in s.runs if not r.run.oom and not r.fits]
    assert misses == []
