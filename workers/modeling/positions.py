"""Where each token is and what it may attend to: RoPE's rotation and its tables (with the
`linear`, `llama3` and `yarn` scalings, as `transformers` scales them), positions restarting
in each document (`data.document_mask`), and the attention masks of document masks and
sliding windows. `workers.modeling.model`'s blocks use them."""

from __future__ import annotations

import functools
import math

import torch

from service.planner.shape import RopeScaling


def rotary(x: torch.Tensor, base: float = 10000.0,
           positions: torch.Tensor | None = None,
           scaling: RopeScaling | None = None) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) queries or keys by their position (RoPE, with the
    halves of each head as the pairs, as Llama's Hugging Face port does); `scaling`: the
    frequencies' scaling (`linear`, `llama3`, `yarn`: `inverse_frequencies`).

    Computed as `x * cos + rotate_half(x) * sin` with the position tables made once per
    (length, head size, base, scaling, device, dtype) (`rotary_tables`): two products and a
    sum per element, each the same IEEE operation on the same operands as the explicit pairs
    `[x1 cos - x2 sin, x1 sin + x2 cos]`, so the result (and its gradient) is bit for bit that
    of the pairs, without drawing the tables again at every block and step.

    `positions` (batch, seq): each token's position (with document masks, restarting at 0 in
    each document: `document_positions`); None: 0 .. seq-1."""
    s, d = x.shape[-2], x.shape[-1]
    cos, sin = rotary_tables(s, d, float(base), x.device, x.dtype, scaling)
    if positions is not None:
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def inverse_frequencies(d: int, base: float, scaling: RopeScaling | None,
                        device: torch.device | None = None) -> torch.Tensor:
    """RoPE's d / 2 inverse frequencies in fp32, scaled as `transformers`'
    `modeling_rope_utils` scales them (`_compute_linear_scaling_rope_parameters`,
    `_compute_llama3_parameters`, `_compute_yarn_parameters`)."""
    exponents = torch.arange(0, d, 2, dtype=torch.float32, device=device) / d
    inv = base ** -exponents
    if scaling is None:
        return inv
    factor = scaling.factor
    if scaling.rope_type == "linear":
        return inv / factor
    original = float(scaling.original_max_position_embeddings or 0)
    if scaling.rope_type == "llama3":
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > original / low, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, smoothed, scaled)
    # yarn: from the extrapolated (plain) to the interpolated (/ factor) frequencies, ramped
    # between the dimensions that turn beta_fast and beta_slow times over the original context
    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=device) - lo) / (hi - lo)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos = base ** exponents
    return (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation


@functools.lru_cache(maxsize=32)
def rotary_tables(s: int, d: int, base: float, device: torch.device, dtype: torch.dtype,
                  scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's (s, d) cos and sin tables, each half-width table repeated for both halves of a
    head: the angles in fp32 (times yarn's attention factor), then cast to `dtype`. Plain
    tensors (made outside any inference mode or autograd record), shared by every block; a
    few keys per process (one per sequence length and model)."""
    with torch.inference_mode(False), torch.no_grad():
        inv = inverse_frequencies(d, base, scaling, device)
        angle = torch.outer(torch.arange(s, dtype=torch.float32, device=device), inv)
        cos, sin = angle.cos(), angle.sin()
        if scaling is not None and scaling.attention_scaling != 1.0:
            cos, sin = cos * scaling.attention_scaling, sin * scaling.attention_scaling
        cos, sin = cos.to(dtype), sin.to(dtype)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


Documents = torch.Tensor
"""(batch, seq) int64: the document each input token belongs to, numbered from 0 in each
window (`data.document_mask`: `workers.trainer.data`). It travels with the hidden states
through every block and pipeline stage (an integer tensor: no gradient), replicated over TP."""


def document_positions(documents: Documents) -> torch.Tensor:
    """(batch, seq) positions that restart at 0 where each document starts (Megatron's
    `reset_position_ids`)."""
    s = documents.shape[-1]
    index = torch.arange(s, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=-1).values


def attention_bias(s: int, window: int | None, documents: Documents | None,
                   device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive attention mask (0 where a query sees a key, -inf elsewhere) of causal
    attention limited to a sliding `window` (a query sees itself and the window - 1 tokens
    before it, as `transformers`' `sliding_window_overlay`: `kv > q - window`) and to each
    token's own document (Megatron's `reset_attention_mask`): (batch or 1, 1, s, s), or None
    for plain causal attention (`scaled_dot_product_attention(is_causal=True)`).

    An explicit mask for `scaled_dot_product_attention`, not a flex_attention block mask:
    torch's flex_attention has no backward on CPU (eager), and this one runs the same on CPU
    and GPU (the memory-efficient kernel there). The kernels compute every block, masked or
    not: a document mask saves no FLOPs, and costs the mask's memory (`service.planner.memory`).
    One mask per (documents, window, dtype) is built per forward, shared by the blocks of a
    stage (`bias_for`)."""
    if documents is None and (window is None or window >= s):
        return None
    q = torch.arange(s, device=device)
    seen = q[None, :] <= q[:, None]
    if window is not None and window < s:
        seen = seen & (q[None, :] > q[:, None] - window)
    seen = seen[None, None]
    if documents is not None:
        seen = seen & (documents[:, None, :, None] == documents[:, None, None, :])
    bias = torch.zeros(seen.shape, dtype=dtype, device=device)
    return bias.masked_fill_(~seen, float("-inf"))


def bias_for(s: int, window: int | None, documents: Documents | None, device: torch.device,
              dtype: torch.dtype) -> torch.Tensor | None:
    """`attention_bias`, built once per documents tensor (kept on it: every block of a stage
    gets the same tensor object, each micro-batch a new one) or per (s, window) without one."""
    if documents is None:
        return _window_bias(s, window, device, dtype)
    key = (s, window, dtype)
    cache: dict = documents.__dict__.setdefault("_attention_bias", {})
    if key not in cache:
        with torch.no_grad():
            cache[key] = attention_bias(s, window, documents, device, dtype)
    return cache[key]


@functools.lru_cache(maxsize=8)
def _window_bias(s: int, window: int | None, device: torch.device,
                 dtype: torch.dtype) -> torch.Tensor | None:
    with torch.inference_mode(False), torch.no_grad():
        return attention_bias(s, window, None, device, dtype)
