"""A job's checkpoint tag as a Hugging Face model folder (`trident export`,
`POST /api/v1/jobs/{id}/exports`), in a task on the cluster (`workers.launch.export_task`) or a
process of its own (`write_export`, `main`), without torch.distributed.

A DeepSpeed tag (`workers.checkpoint.saving`) holds the module's weights per TP rank:

- pp = 1: `mp_rank_<tp>_model_states.pt`, its `module` the whole model's state dict (DP rank 0
  writes it; under ZeRO 1 and 2 the module is whole on every DP rank), keys
  `layers.<k>.<name>` with k the flat layer index (0 the embedding, 1..L the blocks, L+1 the
  head);
- pp > 1: `layer_<k>-model_<tp>-model_states.pt` per flat layer k and TP rank, the layer's own
  state dict;
- ZeRO-3: `zero_pp_rank_<dp>_mp_rank_<tp>_optim_states.pt` (`bf16_zero_...` in bf16), each DP
  rank's partitions.

The layout that wrote the tag (`trident-layout.json`: tp, pp, zero, virtual_stages) says which
files to read; the TP shards are joined by `workers.checkpoint.full_state.join_shards` under the
canonical
names, and `workers.checkpoint.hf_weights.write_hf` writes the folder tensor by tensor (each
joined when it is written: `lazy_full`). Every file is read with
`torch.load(weights_only=True)`: a checkpoint folder is written by the job's ranks, which may
run a user's code, so nothing in it is unpickled beyond tensors and plain values.

ZeRO-3 tags hold no weights in their module files: `zero3_module` joins the flat fp32
partitions of every DP rank's optimizer file as DeepSpeed's `zero_to_fp32` does (loaded weights
only, with DeepSpeed's loss scaler and stage enum allowed through). Not covered (refused naming
the layout): interleaved stages' per-rank files. The weights exported are the module's, in the
precision the job computed in (its fp32 weights for an fp32 job; ZeRO-3: the fp32 master
weights).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

import torch

from service.files.checkpoint_dirs import ExportRefused
from service.files.checkpoint_tags import tag
from service.files.export import ExportDone, ExportWork
from service.planner.shape import ModelShape
from workers.checkpoint import mapped
from workers.checkpoint.full_state import join_shards, unfuse, unfused_names
from workers.checkpoint.hf_weights import DEFAULT_MAX_SHARD_BYTES, Lazy, write_hf
from workers.checkpoint.tag_forms import flat_layout, optim_states


def canonical(k: int, local: str, layers: int) -> str | None:
    """The canonical name of parameter `local` of flat layer `k` (None: a tied head's copy
    of the embedding, exported once from the embedding)."""
    if k == 0:
        return "embed." + local
    if k == layers + 1:
        return None if local == "tok" else "head." + local
    return f"layers.{k - 1}.{local}"


def _load(path: str) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _load_optimizer(path: str) -> Any:
    """A ZeRO optimizer file, weights only: of DeepSpeed's own classes, only its loss scaler
    and ZeRO stage enum (plain values) are let through."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum]):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def zero3_module(path: str, tp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    """TP rank `tp_rank`'s whole module (fp32) from a ZeRO-3 tag's DP partitions
    (`zero3_lazy`'s tensors, made)."""
    return {name: make() for name, make in zero3_lazy(path, tp_rank, dp).items()}


def zero3_lazy(path: str, tp_rank: int, dp: int) -> dict[str, Lazy]:
    """TP rank `tp_rank`'s module (fp32, lazy) from a ZeRO-3 tag's DP partitions, as
    DeepSpeed's `zero_to_fp32` joins them (`_zero3_merge_trainable_params`): every rank's
    parameter groups' flat fp32 partitions, one after the other; each parameter, in the
    order of the model file's `param_shapes`, takes ceil(numel / dp) elements of every rank's
    flat partitions, joined over the ranks and cut to its numel. The optimizer files are
    mapped, not read: a parameter's elements are read when it is made."""
    shapes: dict[str, Any] = {}
    for group in _load(os.path.join(
            path, f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt"))["param_shapes"]:
        shapes.update(group)
    flats = [_load_optimizer(optim_states(path, d, tp_rank, ExportRefused))[
        "optimizer_state_dict"]["fp32_flat_groups"] for d in range(dp)]
    held = sum(int(g.numel()) for g in flats[0])
    need = sum(-(-int(torch.Size(s).numel()) // dp) for s in shapes.values())
    if need > held:
        raise ExportRefused(f"{path}: the ZeRO-3 partitions hold {held} elements"
                            f" per rank, the parameters need {need}")
    out: dict[str, Lazy] = {}
    offset = 0
    for name, shape in shapes.items():
        numel = int(torch.Size(shape).numel())
        part = -(-numel // dp)
        out[name] = _partitioned(flats, offset, part, numel, tuple(shape))
        offset += part
    return out


def _partitioned(flats: list[list[torch.Tensor]], offset: int, part: int, numel: int,
                 shape: tuple[int, ...]) -> Lazy:
    """A parameter of `zero3_lazy`: elements [offset, offset + part) of each rank's groups
    (taken as one flat tensor), joined and cut to `numel`."""
    def make() -> torch.Tensor:
        return torch.cat([_span(groups, offset, part) for groups in flats])[:numel].view(shape)
    return make


def _span(groups: list[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """Elements [start, start + length) of `groups` one after the other, without joining
    the groups (a rank's whole partition) first."""
    pieces, at = [], 0
    for g in groups:
        n = int(g.numel())
        lo, hi = max(start, at), min(start + length, at + n)
        if lo < hi:
            pieces.append(g.narrow(0, lo - at, hi - lo))
        at += n
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def consolidate(directory: str, step: int, shape: ModelShape) -> dict[str, torch.Tensor]:
    """The full tensors (canonical names) of tag `step` under `directory` (`lazy_full`'s,
    made)."""
    return {name: make() for name, make in lazy_full(directory, step, shape).items()}


def lazy_full(directory: str, step: int, shape: ModelShape) -> dict[str, Lazy]:
    """The full tensors (canonical names) of tag `step` under `directory`, lazy: the tag's
    files are mapped (`torch.load(mmap=True)`), and each tensor's TP shards are joined when it
    is made, so that the export holds one full tensor at a time."""
    path = os.path.join(directory, tag(step))
    if not os.path.isdir(path):
        raise ExportRefused(f"no checkpoint tag {tag(step)} in {directory}")
    layout = flat_layout(directory, step, ExportRefused, "not exported yet")
    tp, pp = int(layout["tp"]), int(layout["pp"])
    shards: dict[str, list[Lazy]] = {}

    def take(k: int, local: str, tensor: Lazy) -> None:
        name = canonical(k, local, shape.layers)
        if name is None:  # a tied head's copy of the embedding
            return
        parts = unfused_names(name, shape)  # a fused q/k/v or gate/up: its projections
        for i, part in enumerate(parts):
            shards.setdefault(part, []).append(
                tensor if len(parts) == 1 else _piece(name, tensor, shape, tp, i))

    for r in range(tp):
        if layout.get("zero") == 3:
            for key, make in zero3_lazy(path, r, int(layout["dp"])).items():
                _, flat, local = key.split(".", 2)
                take(int(flat), local, make)
        elif pp == 1:
            module = _load(os.path.join(path, f"mp_rank_{r:02d}_model_states.pt"))["module"]
            for key, tensor in module.items():
                _, k, local = key.split(".", 2)
                take(int(k), local, _const(tensor))
        else:
            for k in range(shape.layers + 2):
                for local, tensor in _load(os.path.join(
                        path, f"layer_{k:02d}-model_{r:02d}-model_states.pt")).items():
                    take(k, local, _const(tensor))
    for name, parts in shards.items():
        if len(parts) != tp:
            raise ExportRefused(f"{path}: {name} has {len(parts)} TP shards, not tp({tp})")
    # No copy: one TP shard is the tag's own tensor, mapped from its file, and several
    # are joined into a new one (`safetensors_out.write_safetensors` writes either as it is).
    return {name: _joined(name, parts) for name, parts in shards.items()}


def _const(t: torch.Tensor) -> Lazy:
    return lambda: t


def _piece(name: str, make: Lazy, shape: ModelShape, tp: int, i: int) -> Lazy:
    return lambda: unfuse(name, make(), shape, tp)[i][1]


def _joined(name: str, parts: list[Lazy]) -> Lazy:
    return lambda: join_shards(name, [p() for p in parts])


def _released(make: Lazy, path: str) -> Lazy:
    def made() -> torch.Tensor:
        t = make()
        mapped.release(path)
        return t
    return made


def export(directory: str, step: int, shape: ModelShape, out: str,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write tag `step` of the checkpoint folder `directory` as a Hugging Face model folder
    `out` (`config.json`, safetensors in shards of at most `max_shard_bytes`, tensor by
    tensor: `write_hf`); the files written. ExportRefused naming why not. Once each tensor is
    made, the tag's pages read so far leave the resident set (`workers.checkpoint.mapped`):
    the tensor's sources, and the shard just written from the tag's own tensors."""
    path = os.path.join(directory, tag(step))
    try:
        lazy = lazy_full(directory, step, shape)
        return write_hf(shape, {k: _released(make, path) for k, make in lazy.items()}, out,
                        max_shard_bytes)
    except (OSError, KeyError) as exc:
        raise ExportRefused(f"{directory}/{tag(step)}: {exc}") from exc
    except ValueError as exc:
        raise ExportRefused(str(exc)) from exc


def write_export(work: ExportWork) -> ExportDone:
    """The export `work` describes (`service.files.export`): tag `work.step` of its checkpoint
    folder written as the Hugging Face folder `work.destination`, first as a hidden folder
    beside it (`.<name>.partial`), renamed once every file is written, so that a task cut
    short leaves no folder that looks whole. ExportDone with the files and their bytes, or
    with `refused` naming why not (a tag that is not exported, a destination taken)."""
    dest = work.destination.rstrip(os.sep)
    partial = os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}.partial")
    if os.path.lexists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        return ExportDone(refused=f"{dest} exists already and is not an empty folder")
    shutil.rmtree(partial, ignore_errors=True)  # an earlier try's
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        files = export(work.checkpoint_dir, work.step, ModelShape.from_fields(work.shape),
                       partial, work.max_shard_bytes)
        size = sum(os.path.getsize(os.path.join(partial, f)) for f in files)
        if os.path.isdir(dest):
            os.rmdir(dest)  # empty: `refusal` let it be named
        os.replace(partial, dest)
    except ExportRefused as exc:
        shutil.rmtree(partial, ignore_errors=True)
        return ExportDone(refused=str(exc))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return ExportDone(files=files, bytes=size)


def main(argv: list[str] | None = None) -> int:
    """`python -m workers.checkpoint.hf_export --work JSON` (an `ExportWork`), or
    `python -m workers.checkpoint.hf_export DIRECTORY STEP OUT --shape JSON
    [--max-shard-bytes N]`: `write_export` in a process of its own
    (`service.files.export.run_in_process`), so that the control plane never imports torch.
    Its last line on stdout is one JSON object: `{"files": [...], "bytes": n}`, or
    `{"refused": reason}` with exit status 3."""
    ap = argparse.ArgumentParser(prog="python -m workers.checkpoint.hf_export",
                                 description=main.__doc__)
    ap.add_argument("directory", nargs="?")
    ap.add_argument("step", nargs="?", type=int)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--work", help="the ExportWork's fields as JSON")
    ap.add_argument("--shape", help="the model's ModelShape fields as JSON")
    ap.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    args = ap.parse_args(argv)
    if args.work:
        work = ExportWork.from_json(json.loads(args.work))
    elif args.out and args.shape:
        work = ExportWork(export_id=0, job_id=0, checkpoint_dir=args.directory, step=args.step,
                          shape=json.loads(args.shape), destination=args.out,
                          max_shard_bytes=args.max_shard_bytes)
    else:
        ap.error("give --work, or DIRECTORY STEP OUT --shape")
    done = write_export(work)
    if done.refused is not None:
        print(json.dumps({"refused": done.refused}), flush=True)
        return 3
    print(json.dumps({"files": done.files, "bytes": done.bytes}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
