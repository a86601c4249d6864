"""The transformer's shape as the planner counts it: parameters and FLOPs.

`ModelShape.from_spec` turns a validated `ModelSpec` into plain numbers; memory.py, timing.py
and capacity.py read only this object. Conventions for architectures follow
`service.contract.presets` (GPT: biases, LayerNorm, learned positions, tied head; Llama: none of
those, SwiGLU, GQA). The built-in trainer (`workers.modeling.model`) builds its model from this
object too, and refuses the traits it does not build, so planner and trainer count the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, cast, get_args

from service.contract.parallel import stage_layers
from service.contract.presets import PRESETS
from service.contract.spec import ModelSpec

Positions = Literal["learned", "rotary", "alibi"]
RopeKind = Literal["linear", "llama3", "yarn"]


@dataclass(frozen=True)
class RopeScaling:
    """A rotary scaling of `transformers`' `modeling_rope_utils` (its names): `linear`
    divides every frequency by `factor`; `llama3` divides the low frequencies (wavelength
    above `original_max_position_embeddings / low_freq_factor`) by `factor`, keeps the high
    ones (below `.../ high_freq_factor`) and blends between; `yarn` ramps from the
    extrapolated to the interpolated frequencies between the `beta_fast` and `beta_slow`
    rotations and multiplies cos and sin by `attention_factor` (default
    0.1 ln(factor) + 1). No parameters: the planner's counts do not change."""

    rope_type: RopeKind
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by (yarn's attention factor; 1 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


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
    """Linear layers carry biases (GPT, BLOOM)."""
    layer_norm: bool
    """Norms are LayerNorm, with a shift (GPT, BLOOM), rather than RMSNorm (Llama)."""
    positions: Positions
    """Position encoding; only `learned` (a seq_len x hidden table) holds parameters."""
    tied: bool
    """The LM head reuses the input embedding (one copy when pp == 1)."""
    dropout: bool = True
    """Dropout after the embedding, on the attention probabilities and on both residual
    branches (GPT, BLOOM: its masks are activations); Llama has none (its presets)."""
    rope_theta: float = 10000.0
    """The base of rotary positions."""
    qkv_bias: bool = False
    """Biases on q, k and v only (Qwen2), when `biases` is off."""
    gelu_tanh: bool = False
    """The GELU MLP uses GELU's tanh approximation (GPT-2's `gelu_new`)."""
    norm_eps: float | None = None
    """The norms' epsilon (None: torch's default)."""
    sliding_window: int | None = None
    """Blocks from `full_attention_layers` on attend to this many tokens at most (themselves
    included); None: full causal attention."""
    full_attention_layers: int = 0
    """Blocks before this one attend fully even with a sliding window (Qwen2)."""
    head_size: int | None = None
    """Each head's size when it is not hidden / heads (Qwen3, Gemma: `head_dim`)."""
    qk_norm: bool = False
    """An RMSNorm over each head of q and of k, before the rotary positions (Qwen3): one
    `head_dim` weight each, replicated over TP."""
    attention_bias: bool = False
    """Biases on q, k, v and the attention output (Llama's `attention_bias`)."""
    mlp_bias: bool = False
    """Biases on every MLP linear (Llama's `mlp_bias`)."""
    rope: RopeScaling | None = None
    """The rotary frequencies' scaling (None: the default kind)."""

    @classmethod
    def from_spec(cls, m: ModelSpec) -> ModelShape:
        traits = PRESETS[m.preset] if m.preset else {}
        swiglu = m.activation == "swiglu"
        positions = traits.get("positions", "rotary" if swiglu else "learned")
        assert positions in get_args(Positions), positions
        return cls(
            layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
            vocab=m.vocab, seq_len=m.seq_len, ffn_hidden=m.ffn_hidden, swiglu=swiglu,
            biases=bool(traits.get("biases", not swiglu)),
            layer_norm=traits.get("norm", "rmsnorm" if swiglu else "layernorm") == "layernorm",
            positions=cast(Positions, positions),
            tied=m.tied if m.tied is not None else bool(traits.get("tied", not swiglu)),
            dropout=bool(traits.get("dropout", not swiglu)), rope_theta=m.rope_theta,
            qkv_bias=m.qkv_bias, gelu_tanh=m.activation == "gelu_tanh", norm_eps=m.norm_eps,
            sliding_window=m.sliding_window, full_attention_layers=m.full_attention_layers,
            head_size=m.head_dim, qk_norm=m.qk_norm, attention_bias=m.attention_bias,
            mlp_bias=m.mlp_bias,
            rope=RopeScaling(**m.rope_scaling.model_dump()) if m.rope_scaling else None)

    @classmethod
    def from_fields(cls, fields: dict) -> ModelShape:
        """The shape of `dataclasses.asdict(shape)` (its JSON, read back)."""
        known = {f for f in cls.__dataclass_fields__}
        kept = {k: v for k, v in fields.items() if k in known}
        if isinstance(kept.get("rope"), dict):
            kept["rope"] = RopeScaling(**kept["rope"])
        return cls(**kept)

    def builtin_trainer_refusal(self) -> str | None:
        """Why the built-in trainer (`workers.modeling.model`) would build a model other than the
        one counted here, naming the traits; None when it builds exactly this one. Checked at
        submission for jobs without an `entrypoint`, and again by the trainer."""
        traits = []
        if self.positions == "alibi":
            traits.append(f"learned or rotary positions, not {self.positions!r}")
        if self.positions == "rotary" and self.head_dim % 2:
            traits.append(f"rotary positions over an even head size, not hidden({self.hidden}) /"
                          f" heads({self.heads}) = {self.head_dim}")
        if not traits:
            return None
        return ("the built-in trainer builds " + " and ".join(traits) + "; use an entrypoint"
                " for this model")

    def window(self, layer: int) -> int | None:
        """Block `layer`'s sliding window, None when it attends to every earlier token of its
        sequence (no window, a window of seq_len or more, or a block before
        `full_attention_layers`)."""
        w = self.sliding_window
        if w is None or w >= self.seq_len or layer < self.full_attention_layers:
            return None
        return w

    @property
    def activation(self) -> Literal["gelu", "swiglu"]:
        return "swiglu" if self.swiglu else "gelu"

    @property
    def learned_positions(self) -> bool:
        return self.positions == "learned"

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of q (and of the attention output projection's input): heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def qkv_biased(self) -> bool:
        return self.biases or self.qkv_bias or self.attention_bias

    @property
    def o_biased(self) -> bool:
        return self.biases or self.attention_bias

    @property
    def mlp_biased(self) -> bool:
        return self.biases or self.mlp_bias

    def _split_vectors(self) -> int:
        """A block's vectors split over TP with their rows: q, k, v and MLP-in biases."""
        return ((self.q_dim + 2 * self.kv_dim) if self.qkv_biased else 0) + \
            ((2 if self.swiglu else 1) * self.ffn_hidden if self.mlp_biased else 0)

    def _whole_vectors(self) -> int:
        """A block's vectors whole on every TP rank: the norms, q/k norms, the output
        projections' biases (added once after the TP sum)."""
        h = self.hidden
        return (4 if self.layer_norm else 2) * h + (2 * self.head_dim if self.qk_norm else 0) \
            + (h if self.o_biased else 0) + (h if self.mlp_biased else 0)

    @property
    def layer_vector_params(self) -> int:
        """Parameters of one block outside its matrices: the norms and the biases."""
        return self._split_vectors() + self._whole_vectors()

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        return self.layer_matmul_params() + self.layer_vector_params

    @property
    def embedding_params(self) -> int:
        """Input side: token embedding (and position table)."""
        return self.vocab * self.hidden + (self.seq_len * self.hidden
                                           if self.learned_positions else 0)

    @property
    def head_params(self) -> int:
        """Output side: final norm and the LM head (its own matrix when untied)."""
        norm = (2 if self.layer_norm else 1) * self.hidden
        return norm + (0 if self.tied else self.vocab * self.hidden)

    @property
    def total_params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.head_params

    def rank_params(self, tp: int, blocks: int, first: bool, last: bool, pp: int = 1,
                    tp_rank: int = 0) -> int:
        """Parameters TP rank `tp_rank` of a pipeline stage holds (Megatron's split): the
        blocks' matrices and column-parallel biases, the token embedding and the LM head
        divided over tp (by vocabulary rows, the first `vocab % tp` ranks one row more);
        norms, row-parallel biases and the position table whole on every rank. `first` /
        `last`: the stage holds the embedding / the final norm and head (with pp > 1 a tied
        head's stage keeps its own copy of the matrix)."""
        h = self.hidden
        block = self.layer_matmul_params() // tp + self._split_vectors() // tp + \
            self._whole_vectors()
        base, extra = divmod(self.vocab, tp)
        rows = (base + (1 if tp_rank < extra else 0)) * h
        n = blocks * block
        if first:
            n += rows + (self.seq_len * h if self.learned_positions else 0)
        if last:
            n += (2 if self.layer_norm else 1) * h
            if not self.tied or (pp > 1 and not first):
                n += rows
        return n

    def pipeline_weights(self) -> list[int]:
        """Parameters of [embedding, block 0 .. L-1, head] as a pipeline lays them out (a tied
        head on its own stage keeps its copy): DeepSpeed's `parameters` partition weights."""
        head = self.head_params + (self.vocab * self.hidden if self.tied else 0)
        return [self.embedding_params, *[self.layer_params] * self.layers, head]

    def stages(self, pp: int, virtual_stages: int = 1,
               partition: str = "uniform") -> list[list[tuple[int, int]]]:
        """Each pipeline rank's [start, end) block ranges
        (`service.contract.parallel.stage_layers`)."""
        return [list(r) for r in _stages(self, pp, virtual_stages, partition)]

    def stage_blocks(self, pp: int, virtual_stages: int = 1,
                     partition: str = "uniform") -> tuple[int, ...]:
        """Blocks on each pipeline rank, all its chunks together (cached: the search asks
        for the same split thousands of times)."""
        return _stage_blocks(self, pp, virtual_stages, partition)

    def layer_matmul_params(self) -> int:
        """Weights that take part in the layer's GEMMs (for FLOPs: 2 per weight per token)."""
        h, f, kv, q = self.hidden, self.ffn_hidden, self.kv_dim, self.q_dim
        return h * (q + 2 * kv) + q * h + (3 if self.swiglu else 2) * h * f

    def layer_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of one block for `tokens` tokens in sequences of seq_len.

        GEMMs: 2 FLOPs per weight per token; attention scores and their use of V:
        2 * 2 * s * heads * head_dim per token (QK^T and AV). For GPT shapes this is
        Narayanan et al.'s 24 b s h^2 + 4 b s^2 h.
        """
        return tokens * (2.0 * self.layer_matmul_params() + 4.0 * self.seq_len * self.q_dim)

    def attention_core_flops(self, tokens: int) -> float:
        """Forward FLOPs of QK^T and AV alone: what selective recompute recomputes."""
        return tokens * 4.0 * self.seq_len * self.q_dim

    def head_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of the LM head projection."""
        return tokens * 2.0 * self.vocab * self.hidden

    def model_flops(self, tokens: int) -> float:
        """Model FLOPs (forward + backward, no recompute) for `tokens` tokens: MFU's numerator.

        Equals 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) for GPT shapes.
        """
        return 3.0 * (self.layers * self.layer_forward_flops(tokens)
                      + self.head_forward_flops(tokens))


@lru_cache(maxsize=4096)
def _stages(shape: ModelShape, pp: int, virtual_stages: int,
            partition: str) -> tuple[tuple[tuple[int, int], ...], ...]:
    weights = shape.pipeline_weights() if partition == "parameters" and pp > 1 else None
    return tuple(tuple(r) for r in stage_layers(shape.layers, pp, virtual_stages, weights))


@lru_cache(maxsize=4096)
def _stage_blocks(shape: ModelShape, pp: int, virtual_stages: int,
                  partition: str) -> tuple[int, ...]:
    return tuple(sum(b - a for a, b in rngs)
                 for rngs in _stages(shape, pp, virtual_stages, partition))
