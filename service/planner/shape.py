"""The transformer's shape as the planner counts it: parameters and FLOPs.

`ModelShape.from_spec` turns a validated `ModelSpec` into plain numbers; memory.py, timing.py
and capacity.py read only this object. Conventions for architectures follow
`service.presets` (GPT: biases, LayerNorm, learned positions, tied head; Llama: none of
those, SwiGLU, GQA).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.presets import PRESETS
from service.spec import ModelSpec


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    ffn_hidden: int
    swiglu: bool
    """Three-matrix gated MLP (Llama) instead of two matrices with GELU (GPT)."""
    biases: bool
    """Linear layers carry biases and norms carry a shift (GPT, BLOOM)."""
    learned_positions: bool
    """A seq_len x hidden position table on the first stage."""
    tied: bool
    """The LM head reuses the input embedding (one copy when pp == 1)."""

    @classmethod
    def from_spec(cls, m: ModelSpec) -> ModelShape:
        traits = PRESETS.get(m.preset, {}) if m.preset else {}
        swiglu = m.activation == "swiglu"
        positions = str(traits.get("positions", "rotary" if swiglu else "learned"))
        assert m.vocab is not None and m.seq_len is not None and m.ffn_hidden is not None
        return cls(
            layers=m.layers_, hidden=m.hidden_, heads=m.heads_, kv_heads=m.kv_heads_,
            vocab=m.vocab, seq_len=m.seq_len, ffn_hidden=m.ffn_hidden, swiglu=swiglu,
            biases=not swiglu, learned_positions=positions == "learned",
            tied=bool(traits.get("tied", not swiglu)))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        h, f, kv = self.hidden, self.ffn_hidden, self.kv_dim
        attn = h * (h + 2 * kv) + h * h
        mlp = (3 if self.swiglu else 2) * h * f
        norms = (4 if self.biases else 2) * h
        biases = (h + 2 * kv + h + f + h) if self.biases else 0
        return attn + mlp + norms + biases

    @property
    def embedding_params(self) -> int:
        """Input side: token embedding (and position table)."""
        return self.vocab * self.hidden + (self.seq_len * self.hidden
                                           if self.learned_positions else 0)

    @property
    def head_params(self) -> int:
        """Output side: final norm and the LM head (its own matrix when untied)."""
        norm = (2 if self.biases else 1) * self.hidden
        return norm + (0 if self.tied else self.vocab * self.hidden)

    @property
    def total_params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.head_params

    def layer_matmul_params(self) -> int:
        """Weights that take part in the layer's GEMMs (for FLOPs: 2 per weight per token)."""
        h, f, kv = self.hidden, self.ffn_hidden, self.kv_dim
        return h * (h + 2 * kv) + h * h + (3 if self.swiglu else 2) * h * f

    def layer_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of one block for `tokens` tokens in sequences of seq_len.

        GEMMs: 2 FLOPs per weight per token; attention scores and their use of V:
        2 * 2 * s * h per token (QK^T and AV). For GPT shapes this is Narayanan et al.'s
        24 b s h^2 + 4 b s^2 h.
        """
        return tokens * (2.0 * self.layer_matmul_params() + 4.0 * self.seq_len * self.hidden)

    def attention_core_flops(self, tokens: int) -> float:
        """Forward FLOPs of QK^T and AV alone: what selective recompute recomputes."""
        return tokens * 4.0 * self.seq_len * self.hidden

    def head_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of the LM head projection."""
        return tokens * 2.0 * self.vocab * self.hidden

    def model_flops(self, tokens: int) -> float:
        """Model FLOPs (forward + backward, no recompute) for `tokens` tokens: MFU's numerator.

        Equals 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) for GPT shapes.
        """
        return 3.0 * (self.layers * self.layer_forward_flops(tokens)
                      + self.head_forward_flops(tokens))
