"""A job's checkpoint tag as a Hugging Face model folder (`trident export --format hf`,
`GET /api/v1/jobs/{id}/export`), on the server, without torch.distributed.

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
names, and `workers.checkpoint.hf_weights.save_hf` writes the folder. Every file is read with
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
import sys
import threading
import time
from typing import Any

import torch

from service.files.checkpoint_dirs import ExportRefused
from service.files.checkpoint_tags import tag
from service.planner.shape import ModelShape
from workers.checkpoint.full_state import join_shards, unfuse
from workers.checkpoint.hf_weights import DEFAULT_MAX_SHARD_BYTES, save_hf
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
    """TP rank `tp_rank`'s whole module (fp32) from a ZeRO-3 tag's DP partitions, as
    DeepSpeed's `zero_to_fp32` joins them (`_zero3_merge_trainable_params`): every rank's
    parameter groups' flat fp32 partitions concatenated; each parameter, in the order of the
    model file's `param_shapes`, takes ceil(numel / dp) elements of every rank's flat tensor,
    joined over the ranks and cut to its numel."""
    shapes: dict[str, Any] = {}
    for group in _load(os.path.join(
            path, f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt"))["param_shapes"]:
        shapes.update(group)
    flats = [torch.cat(_load_optimizer(optim_states(path, d, tp_rank, ExportRefused))[
        "optimizer_state_dict"]["fp32_flat_groups"]) for d in range(dp)]
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in shapes.items():
        numel = int(torch.Size(shape).numel())
        part = -(-numel // dp)
        out[name] = torch.cat([f.narrow(0, offset, part) for f in flats])[:numel].view(
            tuple(shape)).clone()
        offset += part
    if offset > flats[0].numel():
        raise ExportRefused(f"{path}: the ZeRO-3 partitions hold {flats[0].numel()} elements"
                            f" per rank, the parameters need {offset}")
    return out


def consolidate(directory: str, step: int, shape: ModelShape) -> dict[str, torch.Tensor]:
    """The full tensors (canonical names) of tag `step` under `directory`."""
    path = os.path.join(directory, tag(step))
    if not os.path.isdir(path):
        raise ExportRefused(f"no checkpoint tag {tag(step)} in {directory}")
    layout = flat_layout(directory, step, ExportRefused, "not exported yet")
    tp, pp = int(layout["tp"]), int(layout["pp"])
    shards: dict[str, list[torch.Tensor]] = {}

    def take(k: int, local: str, tensor: torch.Tensor) -> None:
        name = canonical(k, local, shape.layers)
        if name is not None:  # a fused q/k/v or gate/up cut into its projections
            for part, piece in unfuse(name, tensor, shape, tp):
                shards.setdefault(part, []).append(piece)

    for r in range(tp):
        if layout.get("zero") == 3:
            for key, tensor in zero3_module(path, r, int(layout["dp"])).items():
                _, flat, local = key.split(".", 2)
                take(int(flat), local, tensor)
        elif pp == 1:
            module = _load(os.path.join(path, f"mp_rank_{r:02d}_model_states.pt"))["module"]
            for key, tensor in module.items():
                _, k, local = key.split(".", 2)
                take(int(k), local, tensor)
        else:
            for k in range(shape.layers + 2):
                for local, tensor in _load(os.path.join(
                        path, f"layer_{k:02d}-model_{r:02d}-model_states.pt")).items():
                    take(k, local, tensor)
    full = {}
    for name, parts in shards.items():
        if len(parts) != tp:
            raise ExportRefused(f"{path}: {name} has {len(parts)} TP shards, not tp({tp})")
        # No copy: one TP shard is the tag's own tensor, mapped from its file, and several
        # are joined into a new one (`write_safetensors` writes either as it is).
        full[name] = join_shards(name, parts)
    return full


def export(directory: str, step: int, shape: ModelShape, out: str,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write tag `step` of the checkpoint folder `directory` as a Hugging Face model folder
    `out` (`config.json`, safetensors); the files written. ExportRefused naming why not."""
    try:
        full = consolidate(directory, step, shape)
    except (OSError, KeyError) as exc:
        raise ExportRefused(f"{directory}/{tag(step)}: {exc}") from exc
    try:
        return save_hf(shape, full, out, max_shard_bytes)
    except ValueError as exc:
        raise ExportRefused(str(exc)) from exc


def _end_with(parent: int) -> None:
    """A thread that ends this process (exit status 4) once `parent` is gone: an API process
    killed mid-export takes its conversion with it, and with it the export slot's lock
    (`service.files.export`) that this process inherited."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(4)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """`python -m workers.checkpoint.hf_export DIRECTORY STEP OUT --shape JSON`: `export` in a
    process of
    its own, as the API's export route runs it (`service.files.export`), so that the server never
    imports torch. Its last line on stdout is one JSON object: `{"files": [...]}`, or
    `{"refused": reason}` with exit status 3."""
    ap = argparse.ArgumentParser(prog="python -m workers.checkpoint.hf_export",
                                 description=main.__doc__)
    ap.add_argument("directory")
    ap.add_argument("step", type=int)
    ap.add_argument("out")
    ap.add_argument("--shape", required=True, help="the model's ModelShape fields as JSON")
    ap.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    ap.add_argument("--parent", type=int, default=0,
                    help="end when this process (the API's) is no longer this one's parent")
    args = ap.parse_args(argv)
    if args.parent:
        _end_with(args.parent)
    shape = ModelShape.from_fields(json.loads(args.shape))
    try:
        files = export(args.directory, args.step, shape, args.out, args.max_shard_bytes)
    except ExportRefused as exc:
        print(json.dumps({"refused": str(exc)}), flush=True)
        return 3
    print(json.dumps({"files": files}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
