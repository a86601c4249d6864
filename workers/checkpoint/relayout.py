"""Loading a checkpoint tag that another layout wrote (`workers.checkpoint.saving.load` asks `how`).

A tag records the layout that wrote it (`workers.checkpoint.tag_forms.written_by`). Loaded under
another:
- as it is, when only the DP degree changed with ZeRO 0 on both sides and no optimizer shards
  in the tag (`dp_free`: each model states file holds the whole optimizer);
- through DeepSpeed's universal form (`universal`, then its `load_universal_checkpoint`) for
  a change of DP degree or of ZeRO stage 1/2 with tp = pp = 1 on both sides;
- otherwise through Trident's layout-free form (`workers.checkpoint.layout_free`), sliced for each
rank; so is a tag written before q, k, v (and gate, up) were fused, under any layout (its
blocks name each projection apart; the form names them so, and the fused parameters are
stacked from them on load).

Each form is converted once, by rank 0, into a folder beside the tag (renamed when whole, so a
conversion cut short is done again) and kept for the next load.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Callable
from typing import Any, Literal

import torch.distributed as dist

from service.contract.spec import JobSpec
from service.files.checkpoint_tags import tag
from workers.checkpoint.tag_forms import (
    FUSED_PROJECTIONS,
    PROJECTIONS,
    UNIVERSAL,
    layout_of,
    written_by,
)


def how(directory: str, step: int, spec: JobSpec) -> Literal["as-is", "universal",
                                                                "layout-free"]:
    """How tag `step` loads under `spec`'s layout (see the module)."""
    wrote = written_by(directory, step)
    now = layout_of(spec)
    if wrote is not None and wrote.pop(PROJECTIONS, None) != FUSED_PROJECTIONS:
        # Written before the fusion: its q, k, v, gate and up held apart.
        if wrote.get("virtual_stages", 1) > 1:
            from workers.checkpoint.layout_free import LayoutRefused
            raise LayoutRefused(
                f"{directory}/{tag(step)} was written before q, k, v and gate, up were fused,"
                " with interleaved stages: its per-rank files hold them apart and are not"
                " converted; resume from a tag written since, or start again")
        return "layout-free"
    if wrote is None or wrote == now or dp_free(directory, step, wrote, now):
        return "as-is"
    if all(x["tp"] == 1 and x["pp"] == 1 and x["zero"] in (1, 2)
           and x.get("virtual_stages", 1) == 1 for x in (wrote, now)):
        return "universal"
    return "layout-free"


def universal_tag(directory: str, step: int) -> str:
    """Collective: the name of tag `step`'s universal form, converted by rank 0 if needed."""
    return str(_converted(directory, step, universal)[0])


def universal(directory: str, step: int) -> tuple[str, float]:
    """Rank 0: tag `step` in DeepSpeed's universal form (`ds_to_universal`), converted into a
    temporary folder and renamed, so that a conversion cut short is done again; cached: the
    second call converts nothing. Its tag name, and the seconds the conversion took (0.0:
    cached)."""
    import time

    from deepspeed.checkpoint.ds_to_universal import main, parse_arguments

    name = tag(step) + UNIVERSAL
    out = os.path.join(directory, name)
    if os.path.isdir(out):
        return name, 0.0
    started = time.monotonic()
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    import sys
    argv, sys.argv = sys.argv, ["ds_to_universal", "--input_folder",
                                os.path.join(directory, tag(step)), "--output_folder", tmp,
                                "--num_extract_workers", "1", "--num_merge_workers", "1"]
    try:
        args = parse_arguments()
    finally:
        sys.argv = argv
    main(args)
    os.replace(tmp, out)
    return name, time.monotonic() - started


def dp_free(directory: str, step: int, wrote: dict[str, int], now: dict[str, int]) -> bool:
    """Whether tag `step` loads as it is under `now`, another DP degree than `wrote`'s: ZeRO 0
    on both sides, the same tp, pp and virtual stages, no optimizer shards in the tag (fp32 and
    fp16 keep the whole optimizer in each model states file, which every DP replica reads)."""
    if any(wrote.get(k) != now.get(k) for k in ("tp", "pp", "virtual_stages")) or \
            wrote.get("zero") != 0 or now.get("zero") != 0:
        return False
    tagged = os.path.join(directory, tag(step))
    return os.path.isdir(tagged) and not glob.glob(os.path.join(tagged, "*optim_states.pt"))


def _converted(directory: str, step: int, convert: Callable[..., Any], *args: Any) -> Any:
    """Collective: `convert(directory, step, *args)` run by rank 0, its result on every rank;
    its failure raised on every rank (a LayoutRefused as it is)."""
    from workers.checkpoint.layout_free import LayoutRefused

    out: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            out = [("ok", convert(directory, step, *args))]
        except LayoutRefused as exc:
            out = [("refused", str(exc))]
        except Exception as exc:  # every rank raises it, not only rank 0
            out = [("failed", f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(out, src=0)
    kind, value = out[0]
    if kind == "refused":
        raise LayoutRefused(value)
    if kind == "failed":
        raise RuntimeError(f"converting {directory}/{tag(step)} for another layout failed:"
                           f" {value}")
    return value


def load_layout_free(engine, directory: str, step: int, spec: JobSpec, groups: Any) -> dict:
    """Collective: load tag `step`, another layout's, through the layout-free form (converted
    once by rank 0) into `engine`, sliced for this rank by `groups` (its `RankGroups`); the
    client state the tag was saved with (its `rng` that of rank 0 of the old layout)."""
    from service.planner.shape import ModelShape
    from workers.checkpoint.layout_free import LayoutRefused, convert, load_into

    if layout_of(spec)["tp"] > 1 and groups is None:
        raise LayoutRefused("resuming under tp > 1 from another layout needs the rank's"
                            " groups")
    folder, _seconds, _bytes = _converted(directory, step, convert,
                                          ModelShape.from_spec(spec.model))
    client = load_into(engine, folder, groups)
    dist.barrier()
    return client
