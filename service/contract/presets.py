"""Model presets: named transformer shapes that a spec can refer to by `model.preset`.

`service.contract.spec.ModelSpec` copies the dimension keys (layers, hidden, heads, kv_heads, vocab,
seq_len, ffn_hidden, activation) into the spec. More keys describe the architecture, for the
planner's parameter count and the built-in trainer (both through `service.planner.shape`), and
are ignored by the spec:

- `positions`: `learned` (GPT-3: a seq_len x hidden table), `rotary` (Llama) or `alibi`
  (BLOOM); only `learned` holds parameters.
- `tied`: whether the LM head shares the input embedding matrix.
- `biases`: whether the linear layers carry biases.
- `norm`: `layernorm` (with a shift) or `rmsnorm`.

`rope_theta` and `rope_scaling` (Llama 3: base 500000; 3.1+: `llama3` scaling) are spec fields
a preset supplies as it does the dimensions.

Without a preset (and for keys a preset leaves out), `gelu` models are counted as GPT
(biases, LayerNorm, learned positions, tied head) and `swiglu` models as Llama (no biases,
RMSNorm, rotary, untied head).
"""

from __future__ import annotations

PresetValue = int | float | str | bool | dict[str, str | float | int]

_GPT3: dict[str, PresetValue] = {
    "vocab": 50257, "seq_len": 2048, "positions": "learned", "tied": True}
_LLAMA2: dict[str, PresetValue] = {
    "vocab": 32000, "seq_len": 4096, "activation": "swiglu", "positions": "rotary",
    "tied": False}
_LLAMA3: dict[str, PresetValue] = {
    "vocab": 128256, "seq_len": 8192, "activation": "swiglu", "positions": "rotary",
    "tied": False, "rope_theta": 500000.0}
# Llama 3.1, 3.2 and 3.3 (their released config.json): llama3 RoPE scaling over Llama 3's
# 8192-token pretraining context (factor 8; 3.2's small models 32), 128K positions.
_LLAMA31: dict[str, PresetValue] = {
    **_LLAMA3, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}
_LLAMA32: dict[str, PresetValue] = {
    **_LLAMA3, "tied": True,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}

PRESETS: dict[str, dict[str, PresetValue]] = {
    # For tests and the demo: trains in seconds on two CPU ranks.
    # Its architecture is the built-in trainer's: LayerNorm, no biases, learned positions,
    # untied head, whatever activation a spec overrides it with.
    "gpt-tiny": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32,
                 "positions": "learned", "tied": False, "biases": False, "norm": "layernorm"},
    # GPT-3 family (Brown et al. 2020, Table 2.1), vocab 50257, context 2048.
    "gpt3-125m": {"layers": 12, "hidden": 768, "heads": 12, **_GPT3},
    "gpt3-350m": {"layers": 24, "hidden": 1024, "heads": 16, **_GPT3},
    "gpt3-760m": {"layers": 24, "hidden": 1536, "heads": 16, **_GPT3},
    "gpt3-1.3b": {"layers": 24, "hidden": 2048, "heads": 16, **_GPT3},
    "gpt3-2.7b": {"layers": 32, "hidden": 2560, "heads": 32, **_GPT3},
    "gpt3-6.7b": {"layers": 32, "hidden": 4096, "heads": 32, **_GPT3},
    "gpt3-13b": {"layers": 40, "hidden": 5120, "heads": 40, **_GPT3},
    "gpt3-175b": {"layers": 96, "hidden": 12288, "heads": 96, **_GPT3},
    # Llama 2 (Touvron et al. 2023, Table 1 and the released configs); 70B uses GQA with 8
    # key/value heads.
    "llama2-7b": {"layers": 32, "hidden": 4096, "heads": 32, "ffn_hidden": 11008, **_LLAMA2},
    "llama2-13b": {"layers": 40, "hidden": 5120, "heads": 40, "ffn_hidden": 13824, **_LLAMA2},
    "llama2-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
                   "ffn_hidden": 28672, **_LLAMA2},
    # Llama 3 / 3.1 (Llama Team 2024, Table 3): GQA with 8 key/value heads everywhere, rotary
    # base 500000; 405B exists as 3.1 only (llama3 scaling).
    "llama3-8b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8,
                  "ffn_hidden": 14336, **_LLAMA3},
    "llama3-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
                   "ffn_hidden": 28672, **_LLAMA3},
    "llama3-405b": {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8,
                    "ffn_hidden": 53248, **_LLAMA31},
    "llama3.1-8b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8,
                    "ffn_hidden": 14336, **_LLAMA31},
    "llama3.1-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
                     "ffn_hidden": 28672, **_LLAMA31},
    "llama3.2-1b": {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8,
                    "ffn_hidden": 8192, **_LLAMA32},
    "llama3.2-3b": {"layers": 28, "hidden": 3072, "heads": 24, "kv_heads": 8,
                    "ffn_hidden": 8192, **_LLAMA32},
    "llama3.3-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
                     "ffn_hidden": 28672, **_LLAMA31},
    # BLOOM (BigScience 2022): ALiBi positions, 250880-token vocabulary, tied head.
    "bloom-176b": {"layers": 70, "hidden": 14336, "heads": 112, "vocab": 250880,
                   "seq_len": 2048, "positions": "alibi", "tied": True},
}

# Families for capacity questions ("the largest model of this family each strategy trains").
FAMILIES: dict[str, list[str]] = {
    "gpt3": ["gpt3-125m", "gpt3-350m", "gpt3-760m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b",
             "gpt3-13b", "gpt3-175b"],
    "llama2": ["llama2-7b", "llama2-13b", "llama2-70b"],
    "llama3": ["llama3-8b", "llama3-70b", "llama3-405b"],
}
