"""What moving a job to another layout costs: save a tag, convert it for the new layout, resume
from it (`trident plan --compare JOB` with another layout; docs/checkpoints.md, "What each
move costs").

A small model of bytes per second, fitted to what `bench/checkpoint_scale.py` measured on 2 CPU
ranks (gpt3-350m, fp32; docs/benchmarks.md): a rank writes its share of the tag at
`SAVE_BYTES_PER_S`; each rank of the new layout converts its share of the tag's files into the
layout-free form (`workers.checkpoint.rank_form`) at `CONVERT_BYTES_PER_S` and then loads its
share at `LOAD_BYTES_PER_S`. The path follows the rule of
`workers.checkpoint.relayout.how` on the two layouts: the same layout loads as it is, a change
of DP degree (or ZeRO 1 <-> 2) with tp = pp = 1 through DeepSpeed's universal form, any other
through the layout-free form. Rates of another machine (disks, cores) differ: the figures are
an order of magnitude, with their source named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from service.contract.spec import ParallelSpec
from service.planner.shape import ModelShape

SOURCE = ("bench/checkpoint_scale.py --steps 2, gpt3-350m fp32 ZeRO-1 on 2 CPU ranks of the"
          " shared 2-core development machine, 2026-12-07 16:06 UTC (docs/benchmarks.md)")
SAVE_BYTES_PER_S = 129e6
"""A rank's synchronous save: its share of the tag over the seconds the save blocked the step
(a 5.66 GB tag, 2 ranks, 22.0 s)."""
CONVERT_BYTES_PER_S = 977e6
"""A rank's conversion: its share of the source tag over the conversion's seconds (the median
of tp 2 -> 1, pp 1 -> 2 and ZeRO-1 -> 3 on 2 ranks: 2.9, 2.7 and 3.2 s for 2.83 GB each)."""
LOAD_BYTES_PER_S = 474e6
"""A rank's load after the conversion: its share of the source tag over the resume's seconds
less the conversion's (the median of the same moves: 6.0, 5.2 and 7.1 s for 2.83 GB)."""
OPTIMIZER_BYTES = 12
"""Per parameter: the fp32 master weights and Adam's two moments, in every tag."""

Path = Literal["as-is", "universal", "layout-free"]


@dataclass(frozen=True)
class MoveCost:
    """The seconds of each part of a move, and the tag it carries."""

    path: Path
    tag_bytes: int
    save_s: float
    convert_s: float
    resume_s: float
    source: str = SOURCE

    @property
    def total_s(self) -> float:
        return self.save_s + self.convert_s + self.resume_s


def tag_bytes(shape: ModelShape, precision: str, layout: ParallelSpec) -> int:
    """The bytes of one tag: the optimizer's fp32 state, plus the module's weights in the
    precision computed (ZeRO-3 keeps only the fp32 partitions; ZeRO 0 in fp32 saves the
    weights as the master)."""
    params = shape.total_params
    weights = 0 if layout.zero == 3 or (layout.zero == 0 and precision == "fp32") else \
        params * (4 if precision == "fp32" else 2)
    return params * OPTIMIZER_BYTES + weights


def path(old: ParallelSpec, new: ParallelSpec) -> Path:
    """How a tag of `old` loads under `new` (`workers.checkpoint.relayout.how`'s rule)."""
    keys = ("tp", "pp", "dp", "zero", "virtual_stages")
    if all(getattr(old, k) == getattr(new, k) for k in keys):
        return "as-is"
    if old.zero == new.zero == 0 and all(getattr(old, k) == getattr(new, k)
                                         for k in ("tp", "pp", "virtual_stages")):
        return "as-is"  # a DP change under ZeRO 0: each model states file holds everything
    if all(x.tp == 1 and x.pp == 1 and x.zero in (1, 2) and x.virtual_stages == 1
           for x in (old, new)):
        return "universal"
    return "layout-free"


def move_cost(shape: ModelShape, precision: str, old: ParallelSpec,
              new: ParallelSpec) -> MoveCost:
    """What moving a job of `shape` from layout `old` to `new` costs (see the module)."""
    saved = tag_bytes(shape, precision, old)
    how = path(old, new)
    return MoveCost(
        path=how, tag_bytes=saved,
        save_s=saved / old.dims.world_size / SAVE_BYTES_PER_S,
        convert_s=0.0 if how == "as-is" else saved / new.dims.world_size / CONVERT_BYTES_PER_S,
        resume_s=saved / new.dims.world_size / LOAD_BYTES_PER_S)
