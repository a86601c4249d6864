"""Test helper: ranks that write checkpoints as the trainer did before q, k, v (and a SwiGLU
MLP's gate, up) were fused into one parameter each, for the tests that such tags still resume.

`UnfusedBlock` is the block of that time (each projection its own `ColumnParallelLinear`,
registered in its order: ln1, q, k, v, o, [q_norm, k_norm], ln2, up, [gate], down; the same
seeded numbers); `rank_main` runs `tests.workers_spawn`'s rank with it in place of `Block`, and
with the tag's layout file as it was then (no `projections` record).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F

from service.planner.shape import ModelShape
from workers.modeling import model
from workers.modeling.model import INIT_STD, Block
from workers.modeling.positions import Documents, bias_for, document_positions, rotary
from workers.modeling.seeded_init import SeededInit
from workers.modeling.tp import ColumnParallelLinear, RankGroups


class UnfusedBlock(Block):
    """The block before the fusion: q, k, v, up and gate each a parameter of its own."""

    def __init__(self, index: int, shape: ModelShape, seed: int, groups: RankGroups | None,
                 *args: Any, **kwargs: Any) -> None:
        super().__init__(index, shape, seed, groups, *args, **kwargs)
        tp, r = (groups.tp_size, groups.tp_rank) if groups else (1, 0)
        h, q, kv, f = shape.hidden, shape.q_dim, shape.kv_dim, shape.ffn_hidden

        def linear(name: str, rows: int, bias: bool) -> ColumnParallelLinear:
            return ColumnParallelLinear(SeededInit(seed, index, name, INIT_STD, rows), rows, h,
                                        r, tp, bias)

        apart = {"q": linear("q", q, shape.qkv_biased), "k": linear("k", kv, shape.qkv_biased),
                 "v": linear("v", kv, shape.qkv_biased),
                 "up": linear("up", f, shape.mlp_biased)}
        if shape.swiglu:
            apart["gate"] = linear("gate", f, shape.mlp_biased)
        modules = {**{k: m for k, m in self._modules.items() if k not in ("qkv", "gate_up")},
                   **apart}
        order = ["ln1", "q", "k", "v", "o", "q_norm", "k_norm", "ln2", "up", "gate", "down"]
        self._modules = OrderedDict((k, modules[k]) for k in order if k in modules)
        self.__dict__.pop("up", None)  # the fused block's plain None, which would hide it
        self.__dict__.update(qkv=None, gate_up=None)

    def _attention(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = self._enter_tp(self.ln1(x))
        b, s, _ = x.shape
        d = self.shape.head_dim
        q = self.q(x).view(b, s, self.heads, d)
        k = self.k(x).view(b, s, self.kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        if self.shape.positions == "rotary":
            positions = None if documents is None else document_positions(documents)
            base, scaling = self.shape.rope_theta, self.shape.rope
            q = rotary(q, base, positions, scaling)
            k = rotary(k, base, positions, scaling)
        bias = bias_for(s, self.window, documents, x.device, q.dtype)
        if self.recompute == "selective":
            y = self.checkpoint(self._attention_core, q, k, v, bias)
        else:
            y = self._attention_core(q, k, v, bias)
        y = y.transpose(1, 2).reshape(b, s, self.heads * d)
        out = self._leave_tp(self.o(y))
        return out if self.o_bias is None else out + self.o_bias

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        x = self._enter_tp(self.ln2(x))
        gate = self._modules.get("gate")
        y = F.silu(gate(x)) * self.up(x) if gate is not None else \
            F.gelu(self.up(x), approximate="tanh" if self.shape.gelu_tanh else "none")
        out = self._leave_tp(self.down(y))
        return out if self.down_bias is None else out + self.down_bias


def rank_main(*args: Any) -> None:
    """`tests.workers_spawn`'s rank, building `UnfusedBlock`s and writing the layout file as
    it was before the fusion."""
    from tests.workers_spawn import _rank_main
    from workers.checkpoint import saving
    from workers.checkpoint.tag_forms import layout_of

    model.Block = UnfusedBlock  # type: ignore[misc]  # build_layers builds the old block
    saving.layout_record = layout_of  # type: ignore[assignment]  # no `projections` record
    _rank_main(*args)
