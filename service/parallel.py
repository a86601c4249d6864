"""The parallel-layout vocabulary: the axes, the degrees, and where every rank sits.

One frozen `ParallelDims` value is spoken by the spec, the planner, the stored plan, the
workers and the dashboard. Ranks are laid out with coordinates (pp, dp, tp) and tp varying
fastest, so a TP group is a run of adjacent ranks (and packs onto one node), then DP, then PP.
This is the order of DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Dim(StrEnum):
    """The three parallel axes."""

    TP = "tp"
    PP = "pp"
    DP = "dp"


_AXES = tuple(d.value for d in Dim)


@dataclass(frozen=True)
class RankCoord:
    """Where one rank sits in the (pp, dp, tp) grid."""

    rank: int
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the three axes; everything else about the grid is derived from them."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        # A plain tuple, not `Dim`: iterating an enum is slow, and the planner's search
        # builds this for every candidate it evaluates.
        for name in _AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}({value}) must be a positive integer")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return RankCoord(rank=rank, pp=pp, dp=dp, tp=tp)

    def rank(self, *, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def groups(self, dim: Dim) -> list[list[int]]:
        """Every process group along `dim`, as sorted rank lists (all ranks, same order)."""
        out: dict[tuple[int, int], list[int]] = {}
        for r in range(self.world_size):
            c = self.coord(r)
            key = {
                Dim.TP: (c.pp, c.dp),
                Dim.DP: (c.pp, c.tp),
                Dim.PP: (c.dp, c.tp),
            }[dim]
            out.setdefault(key, []).append(r)
        return [out[k] for k in sorted(out)]

    def group_of(self, rank: int, dim: Dim) -> list[int]:
        return next(g for g in self.groups(dim) if rank in g)


def stage_layers(layers: int, pp: int, virtual_stages: int = 1) -> list[list[tuple[int, int]]]:
    """Layer ranges [start, end) owned by each pipeline rank, one range per virtual stage.

    With interleaving, model chunk k of stage s holds the layers of virtual stage k*pp + s
    (Megatron's interleaved schedule), so each rank owns `virtual_stages` separate ranges.
    """
    chunks = pp * virtual_stages
    if layers % chunks:
        raise ValueError(
            f"layers({layers}) is not divisible by pp({pp}) * virtual_stages({virtual_stages})"
            f" = {chunks}"
        )
    per = layers // chunks
    return [[((k * pp + s) * per, (k * pp + s + 1) * per) for k in range(virtual_stages)]
            for s in range(pp)]


def rank_layout(dims: ParallelDims, layers: int,
                virtual_stages: int = 1) -> list[dict[str, object]]:
    """The stored, JSON-ready rank layout: coordinates and the layers each rank runs."""
    stages = stage_layers(layers, dims.pp, virtual_stages)
    rows: list[dict[str, object]] = []
    for r in range(dims.world_size):
        c = dims.coord(r)
        rows.append(
            {
                "rank": r,
                "pp": c.pp,
                "dp": c.dp,
                "tp": c.tp,
                "layers": [list(rng) for rng in stages[c.pp]],
                "first_stage": c.pp == 0,
                "last_stage": c.pp == dims.pp - 1,
            }
        )
    return rows
