"""The layout-free form written by every rank: each rank converts its share of a DeepSpeed tag's
files into pieces of canonical tensors (`workers.checkpoint.tag_read`), and any rank of
another layout reads back only the slices it needs (`FormSource`).

`step<N>.full/` holds, for each unit of the tag (one optimizer file: `tag_read.units`):

- `part-<unit>.safetensors`: the unit's pieces, 1-D, under `<kind>/<canonical name>` (kind:
  `fp32`, `exp_avg`, `exp_avg_sq`), written straight from the tag's memory-mapped tensors
  (`safetensors_out.write_safetensors`, no copy);
- `part-<unit>.json`: for each piece its canonical name, kind, TP rank, the shape of that TP
  rank's tensor (`local`) and the run's offset in it, flattened (`start`);

and, written by rank 0 once every rank's parts are there, `client.pt` (the scalars and rank 0's
client state) and `meta.json` (the layout that wrote the tag, the conversion's seconds and
bytes, and each rank's units, bytes, seconds and peak resident growth). The folder is
written as `step<N>.full.tmp/` and renamed when whole: a conversion cut short is done again.

Unit i goes to rank i % world: with as many ranks as the tag had, each rank reads one file
of the tag and writes its pieces; no process holds more than one unit's files (mapped) and no
copy of them. The full shape of a name is its TP ranks' tensors joined along its TP split
(`full_state.split_of`; a replicated tensor is TP rank 0's).

A folder holding `fp32.safetensors` is the form of before (one file per kind, written by rank
0 alone): `FormSource.open` reads it as it is.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from service.planner.shape import ModelShape
from workers.checkpoint import tag_read
from workers.checkpoint.full_state import VOCAB, LazySlice, split_of
from workers.checkpoint.rss_peak import PeakRss
from workers.checkpoint.safetensors_out import write_safetensors
from workers.checkpoint.tag_forms import FULL, flat_layout, tree_bytes

PART = "part-"
OLD_FORM = "fp32.safetensors"
"""The form of before: one file per kind, whole tensors."""


def prepare(directory: str, step: int) -> tuple[str, dict[str, int] | None]:
    """Rank 0: the form's folder of tag `step`, and the layout that wrote the tag (None: the
    form is there already, nothing to convert). Clears a conversion cut short."""
    from service.files.checkpoint_tags import tag

    out = os.path.join(directory, tag(step)) + FULL
    if os.path.isdir(out):
        return out, None
    wrote = flat_layout(directory, step, tag_read.LayoutRefused, "its per-rank files are"
                        " torch.distributed.pipelining's, not converted")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return out, wrote


def convert_units(directory: str, step: int, wrote: dict[str, int], shape: ModelShape,
                  rank: int, world: int) -> dict[str, Any]:
    """This rank's units (i % world == rank) of tag `step` into the form's temporary folder;
    what it did: its units, bytes written, seconds, peak resident growth (bytes; None where
    /proc cannot say) and Adam's step (from its first unit)."""
    from service.files.checkpoint_tags import tag

    path = os.path.join(directory, tag(step))
    tmp = path + FULL + ".tmp"
    mine = tag_read.units(wrote)[rank::world]
    started = time.monotonic()
    peak = PeakRss()
    stages = tag_read.stage_layers(path, int(wrote["pp"]), int(wrote["tp"]), shape.layers) \
        if int(wrote["zero"]) == 0 and int(wrote["pp"]) > 1 else None
    written = 0
    step_count = None
    for u in mine:
        tensors: dict[str, torch.Tensor] = {}
        index: dict[str, dict[str, Any]] = {}
        for p in tag_read.pieces(path, u, wrote, shape, stages):
            key = f"{p.kind}/{p.name}"
            if key in tensors:
                raise tag_read.LayoutRefused(f"{path}: unit {u.label} holds two runs of"
                                             f" {p.name} ({p.kind}); not converted")
            tensors[key] = p.data
            index[key] = {"name": p.name, "kind": p.kind, "tp_rank": p.tp_rank,
                          "local": list(p.local), "start": p.start,
                          "numel": p.data.numel()}
        name = os.path.join(tmp, f"{PART}{u.label}")
        write_safetensors(tensors, name + ".safetensors", {})
        with open(name + ".json", "w") as f:
            json.dump(index, f)
        written += os.path.getsize(name + ".safetensors")
        if step_count is None:
            step_count = tag_read.adam_step(path, u, int(wrote["zero"]))
        del tensors
    return {"rank": rank, "units": [u.label for u in mine], "bytes": written,
            "seconds": time.monotonic() - started, "peak_growth": peak.growth(),
            "adam_step": step_count}


def finish(directory: str, step: int, wrote: dict[str, int], ranks: list[dict[str, Any]],
           seconds: float) -> tuple[str, float, int]:
    """Rank 0, once every rank's units are written: the client state and `meta.json`, and
    the folder renamed whole. Its folder, seconds and bytes."""
    from service.files.checkpoint_tags import tag

    path = os.path.join(directory, tag(step))
    out = path + FULL
    tmp = out + ".tmp"
    first = os.path.join(path, "zero_pp_rank_0_mp_rank_00_model_states.pt"
                         if int(wrote["zero"]) == 3 else "mp_rank_00_model_states.pt")
    client = tag_read.load(first)
    adam = next((r["adam_step"] for r in ranks if r["adam_step"] is not None), 0.0)
    torch.save({"step": client.get("step", step), "adam_step": adam,
                "data_position": client.get("data_position", step),
                "consumed_samples": client.get("consumed_samples"),
                "global_steps": client.get("global_steps", step),
                "global_samples": client.get("global_samples"),
                "rng": client.get("rng")}, os.path.join(tmp, "client.pt"))
    del client
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"written_by": wrote, "seconds": seconds, "bytes": tree_bytes(tmp),
                   "ranks": ranks}, f)
    os.replace(tmp, out)
    return out, seconds, tree_bytes(out)


def convert(directory: str, step: int, shape: ModelShape) -> tuple[str, float, int]:
    """One process: tag `step` of `directory` in the form, every unit in turn (one unit's
    files held at a time); cached: the second call converts nothing. Its folder, the seconds
    the conversion took (0.0: cached) and its bytes."""
    out, wrote = prepare(directory, step)
    if wrote is None:
        return out, 0.0, tree_bytes(out)
    started = time.monotonic()
    did = convert_units(directory, step, wrote, shape, 0, 1)
    return finish(directory, step, wrote, [did], time.monotonic() - started)


# --- reading ------------------------------------------------------------------------------------


@dataclass
class _Shard:
    """One TP rank's tensor of a name: its shape, offset along the split, and its runs."""

    local: tuple[int, ...]
    runs: list[tuple[str, str, int, int]] = field(default_factory=list)
    """(file, key, start, numel), the runs' offsets in the tensor flattened."""
    at: int = 0


class PiecesSlice:
    """A full tensor of the form as a `full_state.Sliceable`: `[index]` (a tuple of slices of
    the full tensor) reads, from each TP rank's runs that meet it, only the run of elements
    between the index's first and last element in that tensor, each file opened for that read
    only (a mapping kept open would keep every page read so far resident)."""

    def __init__(self, name: str, shards: dict[int, _Shard], opener: Callable[[str], Any]):
        self.name = name
        split = split_of(name)
        self.dim = None if split is None else (0 if split == VOCAB else int(split))
        self.shards = [shards[t] for t in sorted(shards)]
        if self.dim is None:
            self.shards = self.shards[:1]
        first = self.shards[0].local
        shape = list(first)
        if self.dim is not None:
            at = 0
            for s in self.shards:
                s.at = at
                at += s.local[self.dim]
            shape[self.dim] = at
        self.shape = tuple(shape)
        self._open = opener
        self.dtype: torch.dtype | None = None

    def __getitem__(self, index: Any) -> torch.Tensor:
        box = [(s.start or 0, n if s.stop is None else s.stop)
               for s, n in zip(index, self.shape, strict=True)]
        out: torch.Tensor | None = None
        for shard in self.shards:
            lo, hi = [a for a, _ in box], [b for _, b in box]
            if self.dim is not None:
                d, at = self.dim, shard.at
                lo[d], hi[d] = max(lo[d], at) - at, min(hi[d], at + shard.local[d]) - at
                if lo[d] >= hi[d]:
                    continue
            piece = self._read(shard, lo, hi)
            if out is None:
                out = torch.empty([b - a for a, b in box], dtype=piece.dtype)
            if self.dim is None:
                out.copy_(piece)
            else:
                d = self.dim
                start = lo[d] + shard.at - box[d][0]
                out.narrow(d, start, hi[d] - lo[d]).copy_(piece)
            del piece
        assert out is not None, (self.name, index)
        return out

    def _read(self, shard: _Shard, lo: list[int], hi: list[int]) -> torch.Tensor:
        """The box [lo, hi) of a TP rank's tensor from the runs that meet its elements' span."""
        strides = [math.prod(shard.local[k + 1:]) for k in range(len(shard.local))]
        first = sum(a * s for a, s in zip(lo, strides, strict=True))
        last = sum((b - 1) * s for b, s in zip(hi, strides, strict=True)) + 1
        buf: torch.Tensor | None = None
        for file, key, start, numel in shard.runs:
            a, b = max(first, start), min(last, start + numel)
            if a >= b:
                continue
            handle = self._open(file)  # opened per run: its mapped pages go with it
            run = handle.get_slice(key)[a - start:b - start]
            del handle
            if buf is None:
                buf = torch.empty(last - first, dtype=run.dtype)
            buf[a - first:b - first] = run
        assert buf is not None, (self.name, lo, hi)
        return buf.as_strided([b - a for a, b in zip(lo, hi, strict=True)], strides)


class FormSource:
    """A form's folder opened for reading: `kind(k)` is a `full_state.FullSource` (name ->
    a sliceable full tensor, or None) over either form (see the module)."""

    def __init__(self, folder: str) -> None:
        from safetensors import safe_open

        self.folder = folder
        self._handles: dict[str, Any] = {}
        self._safe_open = safe_open
        self.old = os.path.isfile(os.path.join(folder, OLD_FORM))
        self.names: dict[str, dict[str, dict[int, _Shard]]] = {k: {} for k in tag_read.KINDS}
        if self.old:
            return
        for entry in sorted(os.listdir(folder)):
            if not (entry.startswith(PART) and entry.endswith(".json")):
                continue
            file = entry[:-len(".json")] + ".safetensors"
            with open(os.path.join(folder, entry)) as f:
                index = json.load(f)
            for key, p in index.items():
                shards = self.names[p["kind"]].setdefault(p["name"], {})
                shard = shards.setdefault(int(p["tp_rank"]), _Shard(tuple(p["local"])))
                shard.runs.append((file, key, int(p["start"]), int(p["numel"])))

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = self._safe_open(os.path.join(self.folder, file),
                                                  framework="pt")
        return self._handles[file]

    def kind(self, kind: str) -> Callable[[str], Any]:
        if self.old:
            handle = self._open(f"{kind}.safetensors")
            keys = set(handle.keys())
            return lambda name: LazySlice(handle.get_slice(name)) if name in keys else None
        shards = self.names[kind]
        return lambda name: PiecesSlice(name, shards[name], self._fresh) \
            if name in shards else None

    def _fresh(self, file: str) -> Any:
        return self._safe_open(os.path.join(self.folder, file), framework="pt")

    def kind_names(self, kind: str) -> list[str]:
        if self.old:
            return list(self._open(f"{kind}.safetensors").keys())
        return sorted(self.names[kind])

    def close(self) -> None:
        self._handles.clear()


def read_full(folder: str, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full tensor of `kind` in the form `folder`, one at a time."""
    source = FormSource(folder)
    get = source.kind(kind)
    for name in source.kind_names(kind):
        full = get(name)
        yield name, full[tuple(slice(0, n) for n in full.shape)]
    source.close()


def note_load(folder: str, rank: int, layout: dict[str, int], seconds: float,
              peak_growth: int | None, module: Any) -> None:
    """`load-rank<rank>.json` in the form's folder: what this rank's last load from it cost
    (seconds, peak resident growth) against its own shard (`shard_bytes`: its parameters'
    fp32 weights and two moments, 12 bytes each; under ZeRO-3 its partitions) and the
    largest full tensor of the form (`tensor_bytes`: one kind)."""
    from workers.checkpoint.full_state import partitioned

    shard = sum(int(p.ds_tensor.numel()) if partitioned(p) else p.numel()
                for p in module.parameters()) * 12
    source = FormSource(folder)
    largest = max((math.prod(source.kind("fp32")(n).shape) for n in source.kind_names("fp32")),
                  default=0) * 4
    source.close()
    tmp = os.path.join(folder, f"load-rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"layout": layout, "seconds": seconds, "peak_growth": peak_growth,
                   "shard_bytes": shard, "tensor_bytes": largest}, f)
    os.replace(tmp, os.path.join(folder, f"load-rank{rank}.json"))
