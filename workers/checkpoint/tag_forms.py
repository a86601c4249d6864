"""A job's checkpoint tags on disk as the ranks' readers name things: the layout file a tag
carries and the converted forms kept beside it (`step<N>.universal/`, `step<N>.full/`). The
tags' own names (`step<N>/`), the newest complete one and a tree's bytes (`tree_bytes`, here
for the converters) are `service.files.checkpoint_dirs`' (the API and the controller read them too).

Apart from `workers.checkpoint.saving` (which writes and loads tags) so that the converters
(`workers.checkpoint.layout_free`) and the export (`workers.checkpoint.hf_export`) read tags
without importing the trainer's save and load.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable

from service.contract.spec import JobSpec
from service.files.checkpoint_tags import tag
from service.files.checkpoint_tags import tree_bytes as tree_bytes  # the converters' name for it

LAYOUT = "trident-layout.json"
"""Beside a tag's shards: the layout that wrote it (`tp`, `pp`, `dp`, `zero`, `virtual_stages`),
so that a resume under another layout knows to go through the universal form."""
FULL = ".full"
"""`step<N>.full/`: the tag in the layout-free form (`workers.checkpoint.layout_free`), converted
once on the first resume under a layout DeepSpeed's universal form does not carry, and kept (deleted
with its tag)."""
UNIVERSAL = ".universal"
"""`step<N>.universal/`: the tag in DeepSpeed's universal form (per parameter: fp32 weights,
both Adam moments, step), converted once on the first resume under another layout and kept
(deleted with its tag)."""


PROJECTIONS = "projections"
"""The layout file's record of how the tag's blocks hold q, k, v, gate and up: "fused" (one
`qkv` and one `gate_up` parameter, `workers.modeling.tp.FusedColumnParallelLinear`); absent
in a tag written before the fusion, whose blocks held each projection apart."""
FUSED_PROJECTIONS = "fused"


def layout_record(spec: JobSpec) -> dict[str, int | str]:
    """What a tag's layout file holds: `layout_of(spec)` and how its projections are held."""
    return {**layout_of(spec), PROJECTIONS: FUSED_PROJECTIONS}


def layout_of(spec: JobSpec) -> dict[str, int]:
    p = spec.layout
    return {"tp": p.tp, "pp": p.pp, "dp": p.dp, "zero": p.zero,
            "virtual_stages": p.virtual_stages}


def written_by(directory: str, step: int) -> dict[str, int] | None:
    """The layout that wrote tag `step` (None: a tag saved before layouts were recorded)."""
    try:
        with open(os.path.join(directory, tag(step), LAYOUT)) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return None


def flat_layout(directory: str, step: int, refused: Callable[[str], Exception],
                interleaved: str) -> dict[str, int]:
    """The layout that wrote tag `step` when it is known and has no interleaved stages, the
    one check of the readers of a tag's DeepSpeed files (the export, the layout-free
    conversion): otherwise `refused(why)` is raised, `why` naming the tag and, for
    interleaved stages, ending with `interleaved` (what the caller does not do with them)."""
    layout = written_by(directory, step)
    path = os.path.join(directory, tag(step))
    if layout is None:
        raise refused(f"{path}: no {LAYOUT}: the layout that wrote it is unknown")
    if layout.get("virtual_stages", 1) > 1:
        raise refused(f"{path} was written with interleaved stages ({layout}): {interleaved}")
    return layout


def optim_states(path: str, dp_rank: int, mp_rank: int,
                 refused: Callable[[str], Exception]) -> str:
    """The ZeRO optimizer file of DP rank `dp_rank` and model-parallel rank `mp_rank` in tag
    folder `path`: `zero_pp_rank_<d>_mp_rank_<m>_optim_states.pt`, which DeepSpeed names with a
    `bf16_` prefix in bf16. Raises `refused` unless there is exactly one."""
    found = glob.glob(os.path.join(path, f"*zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}"
                                         "_optim_states.pt"))
    if len(found) != 1:
        raise refused(f"{path}: {len(found)} optimizer files of DP rank {dp_rank}, model"
                      f" rank {mp_rank} (one expected)")
    return found[0]
