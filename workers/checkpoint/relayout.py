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

Each form is converted once into a folder beside the tag (renamed when whole, so a conversion
cut short is done again) and kept for the next load: the universal form by rank 0, with as
many extract and merge workers as its node's CPUs; the layout-free form by every rank, each
its share of the tag's files (`workers.checkpoint.rank_form`).
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
    workers = max(1, len(os.sched_getaffinity(0)))  # this node's CPUs; the others ranks wait
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    import sys
    argv, sys.argv = sys.argv, ["ds_to_universal", "--input_folder",
                                os.path.join(directory, tag(step)), "--output_folder", tmp,
                                "--num_extract_workers", str(workers),
                                "--num_merge_workers", str(workers)]
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


def _outcome(work: Callable[[], Any]) -> tuple[str, Any]:
    from workers.checkpoint.layout_free import LayoutRefused

    try:
        return ("ok", work())
    except LayoutRefused as exc:
        return ("refused", str(exc))
    except Exception as exc:  # every rank raises it, not only the one it happened on
        return ("failed", f"{type(exc).__name__}: {exc}")


def _raised(directory: str, step: int, outcomes: list[tuple[str, Any]]) -> list[Any]:
    """The values of every rank's outcome; the first failure raised (a LayoutRefused as it
    is)."""
    from workers.checkpoint.layout_free import LayoutRefused

    for kind, value in outcomes:
        if kind == "refused":
            raise LayoutRefused(value)
        if kind == "failed":
            raise RuntimeError(f"converting {directory}/{tag(step)} for another layout"
                               f" failed: {value}")
    return [value for _, value in outcomes]


def _converted(directory: str, step: int, convert: Callable[..., Any], *args: Any) -> Any:
    """Collective: `convert(directory, step, *args)` run by rank 0, its result on every rank;
    its failure raised on every rank (a LayoutRefused as it is)."""
    out: list[Any] = [None]
    if dist.get_rank() == 0:
        out = [_outcome(lambda: convert(directory, step, *args))]
    dist.broadcast_object_list(out, src=0)
    return _raised(directory, step, out)[0]


def _by_every_rank(directory: str, step: int, shape: Any) -> str:
    """Collective: tag `step` in the layout-free form, each rank converting its share of the
    tag's files (`rank_form.convert_units`), rank 0 preparing the folder and finishing it;
    cached. The form's folder."""
    import time

    from workers.checkpoint import rank_form

    started = time.monotonic()
    out, wrote = _converted(directory, step, lambda d, s: rank_form.prepare(d, s))
    if wrote is None:
        return str(out)
    mine = _outcome(lambda: rank_form.convert_units(directory, step, wrote, shape,
                                                    dist.get_rank(), dist.get_world_size()))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    ranks = _raised(directory, step, every)
    folder, _seconds, _bytes = _converted(
        directory, step, lambda d, s: rank_form.finish(d, s, wrote, ranks,
                                                       time.monotonic() - started))
    return str(folder)


def load_layout_free(engine, directory: str, step: int, spec: JobSpec, groups: Any) -> dict:
    """Collective: load tag `step`, another layout's, through the layout-free form (converted
    once by every rank, each its share) into `engine`, sliced for this rank by `groups` (its
    `RankGroups`); the client state the tag was saved with (its `rng` that of rank 0 of the
    old layout). Each rank records what its load cost in `load-rank<r>.json` of the form's
    folder (`rank_form.note_load`)."""
    import time

    from service.planner.shape import ModelShape
    from workers.checkpoint.layout_free import LayoutRefused, load_into
    from workers.checkpoint.rank_form import note_load
    from workers.checkpoint.rss_peak import PeakRss

    if layout_of(spec)["tp"] > 1 and groups is None:
        raise LayoutRefused("resuming under tp > 1 from another layout needs the rank's"
                            " groups")
    folder = _by_every_rank(directory, step, ModelShape.from_spec(spec.planned_model))
    started, peak = time.monotonic(), PeakRss()
    client = load_into(engine, folder, groups)
    note_load(folder, dist.get_rank(), layout_of(spec), time.monotonic() - started,
              peak.growth(), engine.module)
    dist.barrier()
    return client
