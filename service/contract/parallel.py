"""The parallel-layout vocabulary: the axes, the degrees, and where every rank sits.

One frozen `ParallelDims` value is spoken by the spec, the planner, the stored plan, the
workers and the dashboard. Ranks are laid out with coordinates (pp, dp, tp) and tp varying
fastest, so a TP group is a run of adjacent ranks (and packs onto one node), then DP, then PP.
This is the order of DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model).
The layers are split over the pipeline stages here too, as DeepSpeed splits them: the
`parallel.partition` rule (`Partition`), its boundaries (`partition_uniform`,
`partition_balanced`) and the splits that cannot be made (`layer_split_errors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Literal


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
        """The ranks of `rank`'s group along `dim` (its entry of `groups(dim)`), ascending."""
        c = self.coord(rank)
        if dim == Dim.TP:
            return [self.rank(pp=c.pp, dp=c.dp, tp=t) for t in range(self.tp)]
        if dim == Dim.DP:
            return [self.rank(pp=c.pp, dp=d, tp=c.tp) for d in range(self.dp)]
        return [self.rank(pp=p, dp=c.dp, tp=c.tp) for p in range(self.pp)]


Partition = Literal["uniform", "parameters"]
"""`parallel.partition`: how pipeline stages split layers that need not divide evenly."""

PARTITION_WORK_LIMIT = 2_000_000
"""Most (items^2 x parts) the `parameters` partition's dynamic programme may cost."""


def partition_uniform(items: int, parts: int) -> list[int]:
    """DeepSpeed's `partition_uniform`: boundaries of `parts` runs of `items`, the first
    `items % parts` runs one longer; with fewer items than parts, one item per run."""
    if items <= parts:
        return [min(p, items) for p in range(parts + 1)]
    chunk, extra = divmod(items, parts)
    return [p * chunk + min(p, extra) for p in range(parts + 1)]


def partition_work(items: int, parts: int) -> int:
    return items * items * parts


def layer_split_errors(layers: int, pp: int, virtual_stages: int,
                       partition: str) -> list[tuple[str, str]]:
    """(field, message) for a pipeline split that cannot be made: fewer layers than model
    chunks, or a `parameters` balance too costly to compute (`partition_work`)."""
    chunks = pp * virtual_stages
    if layers < chunks:
        return [("parallel.pp", f"layers({layers}) is fewer than pp({pp}) * virtual_stages"
                 f"({virtual_stages}) = {chunks}: every model chunk needs a layer")]
    if partition == "parameters" and partition_work(layers + 2, chunks) > PARTITION_WORK_LIMIT:
        return [("parallel.partition", f"balancing {layers} layers over {chunks} chunks by"
                 " parameters is too costly to compute; use partition 'uniform'")]
    return []


@lru_cache(maxsize=256)
def partition_balanced(weights: tuple[float, ...], parts: int) -> list[int]:
    """DeepSpeed's `partition_balanced` (its `partition_method='parameters'`): the linear
    partition of `weights` into `parts` contiguous runs with the smallest spread between the
    heaviest and the lightest run, ties broken as DeepSpeed breaks them (the last split)."""
    n, m = len(weights), parts
    if n <= m:
        return partition_uniform(n, m)
    if partition_work(n, m) > PARTITION_WORK_LIMIT:
        raise ValueError(f"balancing {n} layers over {m} stages by parameters costs more than"
                         f" {PARTITION_WORK_LIMIT} steps; use partition 'uniform'")
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    dmax = [[inf] * (m + 1) for _ in range(n + 1)]
    dmin = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    pos = [[0] * (m + 1) for _ in range(n + 1)]
    dmax[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                hi, lo = max(dmax[k][j - 1], run), min(dmin[k][j - 1], run)
                if cost[i][j] >= hi - lo:
                    cost[i][j], dmax[i][j], dmin[i][j], pos[i][j] = hi - lo, hi, lo, k
    out = [n]
    for j in range(m, 0, -1):
        out.append(pos[out[-1]][j])
    return out[::-1]


def stage_layers(layers: int, pp: int, virtual_stages: int = 1,
                 weights: Sequence[float] | None = None) -> list[list[tuple[int, int]]]:
    """Layer ranges [start, end) owned by each pipeline rank, one range per virtual stage.

    Layers need not divide by pp * virtual_stages. Without `weights` the blocks are split as
    DeepSpeed's `partition_uniform` splits them (the first chunks take one block more when
    they do not divide), and the embedding and the head ride on the first and last stage. With
    `weights` = parameters of [embedding, block 0 .. block L-1, head], the chunks are
    DeepSpeed's `partition_method='parameters'` over that list, embedding and head counted.
    With interleaving, model chunk k of stage s holds the layers of virtual stage k*pp + s
    (Megatron's interleaved schedule), so each rank owns `virtual_stages` separate ranges.
    """
    chunks = pp * virtual_stages
    if layers < chunks:
        raise ValueError(
            f"layers({layers}) is fewer than pp({pp}) * virtual_stages({virtual_stages})"
            f" = {chunks}: every model chunk needs a layer")
    if weights is None:
        bounds = partition_uniform(layers, chunks)
    else:
        if len(weights) != layers + 2:
            raise ValueError(f"weights: {len(weights)} for {layers} layers + embedding + head")
        items = partition_balanced(tuple(float(w) for w in weights), chunks)
        # Items are [embedding, blocks, head]: item i + 1 is block i.
        bounds = [min(max(b - 1, 0), layers) for b in items]
        bounds[0], bounds[-1] = 0, layers
    return [[(bounds[k * pp + s], bounds[k * pp + s + 1]) for k in range(virtual_stages)]
            for s in range(pp)]


def rank_layout(dims: ParallelDims,
                stages: Sequence[Sequence[tuple[int, int]]]) -> list[dict[str, object]]:
    """The stored, JSON-ready rank layout: each rank's coordinates and the layers of its
    pipeline stage (`stages`: every stage's ranges, as `stage_layers` splits them)."""
    if len(stages) != dims.pp:
        raise ValueError(f"{len(stages)} stages of layers for pp({dims.pp})")
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
