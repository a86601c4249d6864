"""A DeepSpeed tag's files read one unit at a time, as pieces of canonical tensors: what one
rank of the layout-free conversion (`workers.checkpoint.rank_form`) reads.

A unit is one file of optimizer state: under ZeRO 1-3 the optimizer file of one model-parallel
rank `m` and one DP rank `d` (`zero_pp_rank_<d>_mp_rank_<m>_optim_states.pt`), under ZeRO 0
the model states file of `m` (its whole optimizer; a pipeline's stage also reads its layer
files). The model-parallel rank of a file is `stage * tp + tp_rank` (DeepSpeed's pipeline
grid, axes pipe, data, model). A unit's pieces (`Piece`) are, for each canonical name
(`workers.checkpoint.full_state`) and kind (fp32 master weights, both Adam moments), the
contiguous run of the TP rank's tensor this file holds, flattened, with its offset:

- ZeRO 1/2: the parameter's fragment of the DP rank's flat fp32 partition
  (`param_slice_mappings`); its offset in the parameter is the partition's start
  (`d * partition size`) plus the fragment's start, less the parameter's offset in its
  group's flat tensor (the group's parameters flattened in `param_shapes` order);
- ZeRO-3: each parameter is ceil(numel / dp) elements of every DP rank's flat sub-group (its
  last part padded), in `param_shapes` order;
- ZeRO 0 (fp32): the module's weights are the master weights, the torch AdamW state keyed by
  position in `recipe.param_groups`' groups (decayed matrices, then the rest), whole.

A fused parameter's run (`qkv`, `gate_up`) is cut into its projections' runs (their rows
stack on every TP rank). Files are opened memory-mapped (`torch.load(mmap=True)`): what a
unit does not read (a model states file's module, when only its shapes are wanted) is not
brought into memory, and the pieces are views of the file's tensors, not copies.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from service.planner.shape import ModelShape
from workers.checkpoint.full_state import unfused_names
from workers.checkpoint.tag_forms import optim_states
from workers.modeling.tp import fused_parts

KINDS = ("fp32", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")


class LayoutRefused(RuntimeError):
    """A tag the layout-free form cannot carry to another layout, and why."""


def load(path: str) -> Any:
    """A file of the tag, memory-mapped. Written by the job's own ranks, which DeepSpeed
    itself loads the same way."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def canonical(key: str, stage: int, pp: int, layers: int) -> str | None:
    """The canonical name of DeepSpeed's parameter `key` (its module name) of pipeline stage
    `stage` (None: a tied head's copy of the embedding)."""
    from workers.checkpoint.hf_export import canonical as of_layer

    if key.startswith("tied_modules."):  # tied_modules.<key>.<local>: embedding or head
        local = key.split(".", 2)[2]
        if stage == 0:
            return "embed." + local
        return None if local == "tok" else "head." + local
    if pp == 1:  # GPT: layers.<k>.<local>
        _, k, local = key.split(".", 2)
    else:  # PipelineModule: <k>.<local>, k the flat layer index
        k, local = key.split(".", 1)
    return of_layer(int(k), local, layers)


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one TP rank's tensor of a canonical name, as one file holds it."""

    name: str
    kind: str
    tp_rank: int
    local: tuple[int, ...]
    """The TP rank's whole tensor's shape (its shard of the full tensor)."""
    start: int
    """The run's offset in that tensor, flattened."""
    data: torch.Tensor
    """The run, 1-D."""


@dataclass(frozen=True)
class Unit:
    """One file of optimizer state of the tag (see the module)."""

    m: int
    d: int | None  # None: ZeRO 0, the model states file's optimizer

    @property
    def label(self) -> str:
        return f"m{self.m:02d}" + ("" if self.d is None else f"-d{self.d:02d}")


def units(layout: dict[str, int]) -> list[Unit]:
    """The tag's units, model-parallel rank first."""
    tp, pp, dp, zero = (int(layout[k]) for k in ("tp", "pp", "dp", "zero"))
    if zero == 0:
        return [Unit(m, None) for m in range(pp * tp)]
    return [Unit(m, d) for m in range(pp * tp) for d in range(dp)]


def _cut(name: str, local: tuple[int, ...], start: int, data: torch.Tensor,
         shape: ModelShape, tp: int) -> Iterator[tuple[str, tuple[int, ...], int, torch.Tensor]]:
    """A run of a TP rank's tensor of `name` per canonical name: a fused one's cut into its
    projections' runs (their rows stacked in `fused_parts` order)."""
    names = unfused_names(name, shape)
    if len(names) == 1:
        yield name, local, start, data
        return
    fused = name.split(".")[2]
    width = math.prod(local[1:])
    row = 0
    for part, (_, full_rows) in zip(names, fused_parts(shape)[fused], strict=True):
        rows = full_rows // tp
        lo, hi = row * width, (row + rows) * width
        a, b = max(lo, start), min(hi, start + data.numel())
        if a < b:
            yield part, (rows, *local[1:]), a - lo, data[a - start:b - start]
        row += rows


def _param_shapes(groups: list[dict[str, Any]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    return [[(k, tuple(int(n) for n in s)) for k, s in g.items()] for g in groups]


def _zero12(path: str, u: Unit, dp: int) -> Iterator[tuple[str, str, tuple[int, ...], int,
                                                          torch.Tensor]]:
    assert u.d is not None
    osd = load(optim_states(path, u.d, u.m, LayoutRefused))["optimizer_state_dict"]
    base = osd["base_optimizer_state"]
    state = base["state"] if isinstance(base, dict) else dict(enumerate(base))
    groups = _param_shapes(load(os.path.join(path, f"mp_rank_{u.m:02d}_model_states.pt"))[
        "param_shapes"])
    for gi, (flat, mapping) in enumerate(zip(osd["single_partition_of_fp32_groups"],
                                             osd["param_slice_mappings"], strict=True)):
        st = state.get(gi, {})
        offsets, at = {}, 0
        for key, local in groups[gi]:
            offsets[key] = (at, local)
            at += math.prod(local)
        begins = u.d * flat.numel()
        for key, frag in mapping.items():
            start, numel = int(frag.start), int(frag.numel)
            param_at, local = offsets[key]
            for kind, t in (("fp32", flat), *((k, st[k]) for k in MOMENTS)):
                yield key, kind, local, begins + start - param_at, t.narrow(0, start, numel)


def _zero3(path: str, u: Unit, dp: int) -> Iterator[tuple[str, str, tuple[int, ...], int,
                                                         torch.Tensor]]:
    assert u.d is not None
    groups = _param_shapes(load(os.path.join(
        path, f"zero_pp_rank_{u.d}_mp_rank_{u.m:02d}_model_states.pt"))["param_shapes"])
    osd = load(optim_states(path, u.d, u.m, LayoutRefused))["optimizer_state_dict"]
    state = osd["optimizer_state_dict"]["state"]
    for gi, flat in enumerate(osd["fp32_flat_groups"]):
        st = state.get(gi, {})
        offset = 0
        for key, local in groups[gi]:
            numel = math.prod(local)
            per = math.ceil(numel / dp)
            mine = max(0, min(per, numel - u.d * per))  # the last rank's part is padded
            if mine:
                for kind, t in (("fp32", flat), *((k, st[k]) for k in MOMENTS)):
                    yield key, kind, local, u.d * per, t.narrow(0, offset, mine)
            offset += per


def stage_layers(path: str, pp: int, tp: int, layers: int) -> list[list[int]]:
    """A ZeRO-0 pipeline tag: each stage's flat layer indices. The stages' layers are not
    recorded: each stage takes the next layers whose parameters number what its optimizer
    holds (stages are contiguous runs of layers)."""
    counts = []
    for s in range(pp):
        opt = load(os.path.join(path, f"mp_rank_{s * tp:02d}_model_states.pt"))["optimizer"]
        counts.append(sum(len(g["params"]) for g in opt["param_groups"]))
    sizes = [len(_layer(path, k, 0)) for k in range(layers + 2)]
    out: list[list[int]] = []
    k = 0
    for s, want in enumerate(counts):
        got: list[int] = []
        while k < len(sizes) and sum(sizes[j] for j in got) < want:
            got.append(k)
            k += 1
        if sum(sizes[j] for j in got) != want:
            raise LayoutRefused(f"{path}: stage {s}'s optimizer holds {want} parameters, which"
                                " no run of its layers matches; not converted")
        out.append(got)
    if k != len(sizes):
        raise LayoutRefused(f"{path}: its stages' optimizers hold fewer parameters than its"
                            " layers; not converted")
    return out


def _layer(path: str, k: int, t: int) -> dict[str, torch.Tensor]:
    return dict(torch.load(os.path.join(path, f"layer_{k:02d}-model_{t:02d}-model_states.pt"),
                           map_location="cpu", weights_only=True, mmap=True))


def _stage_module(path: str, ks: list[int], t: int, layers: int) -> dict[str, torch.Tensor]:
    """A pipeline stage's parameters as its PipelineModule names them (`<k>.<local>`; a tied
    module first, as PipelineModule registers its tied modules before its layers)."""
    tied = [k for k in ks if k == layers + 1 and "tok" in _layer(path, k, t)]
    module: dict[str, torch.Tensor] = {}
    for k in tied + [k for k in ks if k not in tied]:
        for local, tensor in _layer(path, k, t).items():
            module[f"{k}.{local}"] = tensor
    return module


def _zero0(path: str, u: Unit, names: Callable[[str], str | None],
           module: dict[str, torch.Tensor] | None) -> Iterator[tuple[str, str, tuple[int, ...],
                                                                    int, torch.Tensor]]:
    """ZeRO 0 (fp32): the module's weights and the torch AdamW state by position in
    `recipe.param_groups`' groups (decayed matrices, then vectors and the embedding's
    tables), each in module order. `module`: a pipeline stage's parameters (pp = 1: the model
    states file's module)."""
    sd = load(os.path.join(path, f"mp_rank_{u.m:02d}_model_states.pt"))
    module, opt = (sd["module"] if module is None else module), sd.get("optimizer")
    if opt is None or module is None:
        raise LayoutRefused(f"{path}: no module or optimizer state in its model states file")
    if any(t.dtype != torch.float32 for t in module.values() if t.is_floating_point()):
        raise LayoutRefused(f"{path}: a ZeRO-0 tag in 16 bits keeps its fp32 master weights"
                            " in DeepSpeed's own optimizer state; not converted")
    order: list[str] = []
    seen: set[int] = set()
    for key, tensor in module.items():
        if key in (sd.get("buffer_names") or []) or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        order.append(key)
    groups = opt["param_groups"]
    if len(groups) > 1:
        def plain(key: str) -> bool:
            name = names(key)
            return module[key].dim() < 2 or name is None or name.startswith("embed.")
        order = [k for k in order if not plain(k)] + [k for k in order if plain(k)]
    index = [i for g in groups for i in g["params"]]
    if len(index) != len(order):
        raise LayoutRefused(f"{path}: the optimizer holds {len(index)} parameters, the module"
                            f" {len(order)}")
    for i, key in zip(index, order, strict=True):
        st = opt["state"].get(i)
        tensor = module[key]
        local = tuple(tensor.shape)
        if st is None or tuple(st["exp_avg"].shape) != local:
            raise LayoutRefused(f"{path}: the optimizer state of parameter {i} does not fit"
                                f" {key} {list(local)}")
        for kind, t in (("fp32", tensor), *((k, st[k]) for k in MOMENTS)):
            yield key, kind, local, 0, t.float().reshape(-1)


def adam_step(path: str, u: Unit, zero: int) -> float:
    """Adam's step count as unit `u` holds it."""
    if zero == 0:
        state = load(os.path.join(path, f"mp_rank_{u.m:02d}_model_states.pt"))[
            "optimizer"]["state"]
        return max((float(s["step"]) for s in state.values()), default=0.0)
    assert u.d is not None
    osd = load(optim_states(path, u.d, u.m, LayoutRefused))["optimizer_state_dict"]
    base = osd["optimizer_state_dict"] if zero == 3 else osd["base_optimizer_state"]
    state = base["state"] if isinstance(base, dict) else dict(enumerate(base))
    return max((float(s.get("step", 0.0)) for s in state.values()), default=0.0)


def pieces(path: str, u: Unit, layout: dict[str, int], shape: ModelShape,
           stages: list[list[int]] | None = None) -> Iterator[Piece]:
    """Unit `u`'s pieces (see the module), one TP rank's runs; a replicated tensor (a norm)
    only from TP rank 0, whose copy is every rank's. `stages`: a ZeRO-0 pipeline's layers per
    stage (`stage_layers`)."""
    from workers.checkpoint.full_state import split_of

    tp, pp, dp, zero = (int(layout[k]) for k in ("tp", "pp", "dp", "zero"))
    s, t = divmod(u.m, tp)

    def names(key: str) -> str | None:
        return canonical(key, s, pp, shape.layers)

    if zero == 3:
        runs = _zero3(path, u, dp)
    elif zero in (1, 2):
        runs = _zero12(path, u, dp)
    else:
        module = _stage_module(path, stages[s], t, shape.layers) if stages else None
        runs = _zero0(path, u, names, module)
    for key, kind, local, start, data in runs:
        name = names(key)
        if name is None:
            continue
        for part, part_local, part_start, run in _cut(name, local, start, data, shape, tp):
            if t == 0 or split_of(part) is not None:
                yield Piece(part, kind, t, part_local, part_start, run)
