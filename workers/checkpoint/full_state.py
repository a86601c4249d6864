"""The model's tensors under canonical full (unsharded) names, whatever the layout.

Every parameter of the built-in model (`workers.modeling.model`) has one canonical name, the same
for every tp, pp and dp:

- `embed.tok` (vocab x hidden), `embed.pos` (seq_len x hidden, learned positions only);
- `layers.<i>.<name>` for block i's parameters: `ln1.weight`, `ln1.bias`, `q.weight`,
  `q.bias`, `k.*`, `v.*`, `o.weight`, `o_bias`, `ln2.*`, `up.*`, `gate.*`, `down.weight`,
  `down_bias` (as `Block` names them; its fused `qkv` and `gate_up` parameters are named by
  their projections, `fused` below);
- `head.ln.weight`, `head.ln.bias`, `head.weight` (an untied head's matrix). A tied head has
  no matrix of its own: the last stage's copy of the embedding (pp > 1) is `embed.tok` too.

`split_of(name)` says how a full tensor is split over the TP group (Megatron's split, as the
layers build it): q, k, v, up and gate (weights and biases) by output rows, in tp even parts;
o and down weights by input columns; `embed.tok` and `head.weight` by vocabulary rows
(`workers.modeling.vocab.vocab_range`: the first `vocab % tp` ranks one row more); everything else
(norms, row-parallel biases, positions) replicated. A pipeline stage holds the names of its
layers; a DP replica (ZeRO 0-2) holds the same tensors as DP rank 0; ZeRO-3 holds a flat
partition of each (`ds_tensor`) that `deepspeed.zero.GatheredParameters` joins.

- `load_full(model, get_full, groups)`: give every rank exactly its shard of each full tensor
  it holds, asking `get_full(name)` for an object sliced as a tensor is (a tensor, or a lazy
  source such as a safetensors slice: only this rank's part is read). Call it after the model
  is built and before `deepspeed.initialize` (whose ZeRO optimizers copy the weights).
- `gather_full(model, groups)`: the full tensors on one rank (TP shards joined, pipeline
  stages gathered, ZeRO-3 partitions gathered), collective over the world.

Fused projections: a block holds q, k and v as one parameter `qkv` ([q_r; k_r; v_r] on TP
rank r, `workers.modeling.tp.FusedColumnParallelLinear`), and a SwiGLU MLP's gate and up as
`gate_up`; the canonical names stay per projection (`q.weight`, ..., `up.bias`), so that the
layout-free form, the Hugging Face maps and checkpoints written before the fusion (which held
the projections apart) name the same tensors. `Entry.parts` says which rows of a fused
parameter are which projection; `unfuse` cuts a fused tensor read from a tag's files.

Both take an optional accessor in place of the parameter's own data (`assign` / `value`), so
that the same names and splits serve tensors shaped like the parameters (an optimizer's Adam
moments, issue 23's layout-free checkpoints). `join_shards` joins TP shards read from files
(the export of a DeepSpeed checkpoint, `workers.checkpoint.hf_export`).

Called by `workers.checkpoint.hf_weights` (init from a Hugging Face checkpoint) and
`workers.checkpoint.hf_export`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from service.planner.shape import ModelShape
from workers.modeling.tp import TIED_COPY, FusedColumnParallelLinear, RankGroups, fused_parts
from workers.modeling.vocab import vocab_range

VOCAB = "vocab"
"""`split_of`'s answer for a tensor split by vocabulary rows (uneven: `vocab_range`)."""
_COLUMN = re.compile(r"^layers\.\d+\.(q|k|v|up|gate)\.(weight|bias)$")
_ROW = re.compile(r"^layers\.\d+\.(o|down)\.weight$")
_FUSED = re.compile(r"^(layers\.\d+\.)(qkv|gate_up)\.(weight|bias)$")


def split_of(name: str) -> int | str | None:
    """How the full tensor `name` is split over the TP group: the dimension split in even
    parts (0: output rows, 1: input columns), `VOCAB` (rows by `vocab_range`), or None
    (replicated)."""
    if name in ("embed.tok", "head.weight"):
        return VOCAB
    if _COLUMN.match(name):
        return 0
    if _ROW.match(name):
        return 1
    return None


def shard_index(name: str, full_shape: tuple[int, ...], tp_rank: int,
                tp: int) -> tuple[slice, ...]:
    """The index of TP rank `tp_rank`'s shard in the full tensor `name` of `full_shape`."""
    split = split_of(name)
    index = [slice(0, n) for n in full_shape]
    if split is None or tp == 1:
        return tuple(index)
    if split == VOCAB:
        start, end = vocab_range(full_shape[0], tp_rank, tp)
        index[0] = slice(start, end)
        return tuple(index)
    assert isinstance(split, int)
    size = full_shape[split]
    if size % tp:
        raise ValueError(f"{name}: tp({tp}) does not divide its dimension {split} ({size})")
    per = size // tp
    index[split] = slice(tp_rank * per, (tp_rank + 1) * per)
    return tuple(index)


def join_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor `name` from every TP rank's shard, in TP rank order."""
    split = split_of(name)
    if split is None or len(shards) == 1:
        return shards[0]
    return torch.cat(shards, dim=0 if split == VOCAB else int(split))


@dataclass(frozen=True)
class Entry:
    """One parameter of this rank and its canonical name."""

    name: str
    param: nn.Parameter
    copy: bool
    """A pipeline's last-stage copy of a tied `embed.tok` (DeepSpeed keeps it equal to the
    first stage's): loaded, never gathered."""
    parts: tuple[tuple[str, int], ...] = ()
    """A fused parameter's projections: (canonical name, rows on this TP rank), stacked in
    this order (`name` is then the fused one, `layers.<i>.qkv.weight`)."""

    @property
    def canonical(self) -> tuple[str, ...]:
        """The canonical names of the tensors this parameter holds (a fused one's several)."""
        return tuple(n for n, _ in self.parts) or (self.name,)

    def pieces(self, local: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """This rank's tensor `local` of the parameter, per canonical name (a fused one's
        projections as tensors of their own, not views holding the others' rows)."""
        if not self.parts:
            return [(self.name, local)]
        return [(n, t.clone()) for (n, _), t in
                zip(self.parts, local.split([rows for _, rows in self.parts]), strict=True)]


def unfused_names(name: str, shape: ModelShape) -> list[str]:
    """The canonical names `unfuse` cuts the tensor `name` into, in order (`[name]` when it
    is no fused one), known without the tensor."""
    found = _FUSED.match(name)
    if not found:
        return [name]
    prefix, fused, kind = found.groups()
    return [f"{prefix}{part}.{kind}" for part, _ in fused_parts(shape)[fused]]


def unfuse(name: str, local: torch.Tensor, shape: ModelShape,
           tp: int) -> list[tuple[str, torch.Tensor]]:
    """A TP rank's tensor of the parameter `name` as a tag's files hold it, per canonical
    name: a fused one (`layers.<i>.qkv.*`, `layers.<i>.gate_up.*`) cut into its projections'
    rows (`workers.modeling.tp.fused_parts`); any other as it is."""
    found = _FUSED.match(name)
    if not found:
        return [(name, local)]
    prefix, fused, kind = found.groups()
    parts = fused_parts(shape)[fused]
    return list(zip([f"{prefix}{part}.{kind}" for part, _ in parts],
                    local.split([rows // tp for _, rows in parts]), strict=True))


def entries(model: nn.Module) -> list[Entry]:
    """This rank's parameters under their canonical names, in model order."""
    from workers.modeling.model import Block, Embedding, Head  # lazily: the export needs no model

    out: list[Entry] = []
    for module in model.modules():
        if isinstance(module, Embedding):
            prefix = "embed."
        elif isinstance(module, Block):
            prefix = f"layers.{module.index}."
        elif isinstance(module, Head):
            prefix = "head."
        else:
            continue
        for local, p in module.named_parameters():
            if isinstance(module, Head) and local == "tok":
                out.append(Entry("embed.tok", p, copy=bool(getattr(p, TIED_COPY, False))))
                continue
            owner, _, kind = local.rpartition(".")
            fused = module.get_submodule(owner) if owner else None
            parts = tuple((f"{prefix}{part}.{kind}", rows) for part, rows in fused.parts) \
                if isinstance(fused, FusedColumnParallelLinear) else ()
            out.append(Entry(prefix + local, p, copy=False, parts=parts))
    return out


class Sliceable(Protocol):
    """A full tensor that can be read in part: `source[index]` gives that part as a tensor."""

    @property
    def shape(self) -> Any: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class LazySlice:
    """A safetensors slice (`safe_open(...).get_slice(name)`) as a `Sliceable`: `shape`, and
    `[index]` reading that part of the file only."""

    def __init__(self, part: Any) -> None:
        self.part = part
        self.shape = tuple(part.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.part[index]


FullSource = Callable[[str], "Sliceable | None"]
"""`get_full(name)`: the full tensor `name` (or a lazy view of it); None: not there."""
Assign = Callable[[nn.Parameter, torch.Tensor], None]
"""`assign(param, shard)`: store this rank's shard of a full tensor for `param`."""
Value = Callable[[nn.Parameter], torch.Tensor]
"""`value(param)`: this rank's (TP-local) tensor for `param`."""


def _tp(groups: RankGroups | None) -> tuple[int, int]:
    return (groups.tp_rank, groups.tp_size) if groups is not None else (0, 1)


def partitioned(p: nn.Parameter) -> bool:
    """Whether ZeRO-3 holds only a partition of `p` (`ds_tensor`) on this rank."""
    return hasattr(p, "ds_tensor") and hasattr(p, "ds_id")


def assign_param(p: nn.Parameter, shard: torch.Tensor) -> None:
    """The default `assign`: copy `shard` into `p` (into this rank's flat ZeRO-3 partition of
    it when ZeRO-3 partitioned it at construction)."""
    with torch.no_grad():
        if partitioned(p):
            part = p.ds_tensor  # type: ignore[attr-defined]  # DeepSpeed's ZeRO-3 attributes
            n = part.ds_numel
            start = dist.get_rank(p.ds_process_group) * n  # type: ignore[attr-defined]
            piece = shard.reshape(-1)[start:start + n]
            part.data[:piece.numel()].copy_(piece.to(part.dtype))
        else:
            p.data.copy_(shard.to(p.dtype))


def _local_shape(p: nn.Parameter) -> tuple[int, ...]:
    return tuple(p.ds_shape) if partitioned(p) else tuple(p.shape)  # type: ignore[attr-defined]


def load_full(model: nn.Module, get_full: FullSource, groups: RankGroups | None = None,
              assign: Assign | None = None) -> list[str]:
    """Give every parameter of this rank its shard of the full tensor `get_full(name)`; the
    names loaded. Reads only this rank's part of each source. ValueError naming the tensors
    missing from the source or whose shape is not the model's. Not collective."""
    tp_rank, tp = _tp(groups)
    assign = assign or assign_param
    missing: list[str] = []
    loaded: list[str] = []
    for e in entries(model):
        local = _local_shape(e.param)
        # Each tensor it holds and its shape on this rank (a fused one's projections).
        wanted = [(n, (rows, *local[1:])) for n, rows in e.parts] or [(e.name, local)]
        shards = []
        for name, mine in wanted:
            source = get_full(name)
            if source is None:
                missing.append(name)
                continue
            full_shape = tuple(int(n) for n in source.shape)
            index = shard_index(name, full_shape, tp_rank, tp)
            want = tuple(s.stop - s.start for s in index)
            if want != mine:
                raise ValueError(f"{name}: the source's shape {list(full_shape)} gives TP rank"
                                 f" {tp_rank} of {tp} a shard of {list(want)}; the model's is"
                                 f" {list(mine)}")
            shards.append(source[index])
        if len(shards) == len(wanted):
            assign(e.param, torch.cat(shards) if e.parts else shards[0].contiguous())
            loaded += [name for name, _ in wanted]
    if missing:
        raise ValueError(f"the source lacks {len(missing)} tensor(s) of the model:"
                         f" {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    return loaded


def _gathered(params: list[nn.Parameter]) -> Any:
    """ZeRO-3's gather of `params` (a no-op context for parameters held whole)."""
    if any(partitioned(p) for p in params):
        import deepspeed
        return deepspeed.zero.GatheredParameters([p for p in params if partitioned(p)])
    from contextlib import nullcontext
    return nullcontext()


def _by_layer(items: list[Entry]) -> Iterator[list[Entry]]:
    """Entries grouped by their layer (so ZeRO-3 gathers one layer at a time)."""
    group: list[Entry] = []
    for e in items:
        if group and e.name.split(".")[:2] != group[0].name.split(".")[:2]:
            yield group
            group = []
        group.append(e)
    if group:
        yield group


def gather_full(model: nn.Module, groups: RankGroups | None = None, value: Value | None = None,
                dst: int = 0) -> dict[str, torch.Tensor]:
    """Collective over the world: every full tensor of the model, on CPU, on global rank
    `dst` (an empty dict elsewhere). TP shards are joined (`join_shards`), stages gathered
    from their TP rank 0 of DP rank 0, ZeRO-3 partitions gathered (with the default `value`,
    the parameter's own data)."""
    tp_group = groups.tp if groups is not None and groups.tp_size > 1 else None
    keep = groups is None or (groups.tp_rank == 0 and groups.dp_rank == 0)
    stage: dict[str, torch.Tensor] = {}
    own = [e for e in entries(model) if not e.copy]
    for layer in _by_layer(own):
        with _gathered([e.param for e in layer]) if value is None else _nullcontext():
            for e in layer:
                whole = (value(e.param) if value is not None else e.param.data)
                for name, local in e.pieces(whole.detach().to("cpu", copy=True)):
                    if tp_group is not None and split_of(name) is not None:
                        shards: list[Any] = [None] * dist.get_world_size(tp_group)
                        dist.all_gather_object(shards, local, group=tp_group)
                        local = join_shards(name, shards)
                    if keep:
                        stage[name] = local
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return stage
    parts: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else []
    dist.gather_object(stage if keep else None, parts if dist.get_rank() == dst else None,
                       dst=dst)
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in (part or {}).items():
            out.setdefault(name, tensor)
    return out


def _nullcontext() -> Any:
    from contextlib import nullcontext
    return nullcontext()
