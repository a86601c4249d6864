"""Tiny Hugging Face models of every family Trident loads, made by `transformers` from a config
at test time (no downloads), and saved with weights far from their init: what
`tests/test_hf_models.py` and the fine-tuning tests load through `init.from_hf`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SEQ = 16
"""The models' context (and the tests' sequence length)."""


def llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=SEQ, rope_theta=5e5,
        rms_norm_eps=1e-6, tie_word_embeddings=False))


def gpt2() -> GPT2LMHeadModel:
    # 63 rows: the vocabulary splits unevenly over tp 2 (32 + 31 rows)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=63,
                                      n_positions=SEQ, bos_token_id=0, eos_token_id=0))


def mistral() -> MistralForCausalLM:
    """A sliding window (5) shorter than the sequence: the window's mask under every layout."""
    return MistralForCausalLM(MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=SEQ, sliding_window=5,
        rms_norm_eps=1e-6, tie_word_embeddings=False))


DIMS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
        "max_position_embeddings": SEQ, "rms_norm_eps": 1e-6}
FAMILIES = {"llama": llama, "gpt2": gpt2, "mistral": mistral}
"""Also under tp 1 and dp 2 with ZeRO-3, and trained and exported."""
EVERY_FAMILY = {
    **FAMILIES,
    # Llama 3.1's RoPE (scaled below an 8-position "pretraining" context), tied head
    "llama3": lambda: LlamaForCausalLM(LlamaConfig(
        **DIMS, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8})),
    # yarn (its attention factor), biases on q, k, v, o and the MLP, heads of 16 (4 x 16 != 32)
    "llama-yarn": lambda: LlamaForCausalLM(LlamaConfig(
        **DIMS, head_dim=16, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 8})),
    # a window as long as the context: the same model as full attention
    "mistral-full": lambda: MistralForCausalLM(MistralConfig(**DIMS, sliding_window=SEQ)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**DIMS)),
    # the first layer full, the second sliding; exported back with the same window
    "qwen2-window": lambda: Qwen2ForCausalLM(Qwen2Config(
        **DIMS, use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    # q/k norms, heads of 16, a tied head, linear RoPE scaling
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(
        **DIMS, head_dim=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0})),
}


def saved(make: Any, where: Path) -> Path:
    """A model of `make` with weights far from their init (random, not small), saved."""
    torch.manual_seed(0)
    model = make()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name or "ln_" in name
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if norm and name.endswith("weight") else 0))
    model.save_pretrained(where)
    return where
