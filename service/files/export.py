"""A job's checkpoint tag exported as a Hugging Face model folder (`trident export`,
`POST /jobs/{id}/exports`): which tag (the one asked for, or the newest complete one), where
the folder may go (under an export root the server allows, in the job owner's folder), what
the task that writes it is given and gives back, and the files of a finished export as the
API serves them, one at a time.

The folder is written by a task on the cluster (`service.control.export_run` runs it; on Ray,
`workers.launch.export_task`), never by the API process: the conversion (reading
DeepSpeed's files with torch, joining TP shards, stages and ZeRO-3 partitions) is the ranks'
package's (`workers.checkpoint.hf_export`). `run_in_process` runs the same conversion as a
process of its own on this host, for a controller with no cluster to place it on.

Destinations are confined as checkpoint folders are (`service.files.checkpoint_dirs`): an
absolute path, with no `..`, whose real path (symlinks resolved) lies in `<root>/<owner>/` of
one of `Settings.export_root_dirs`, not in the data directory (but under its `exports/`), and
that does not exist yet (or is an empty folder): an export never writes over another's files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.contract.spec import ModelSpec
from service.files.checkpoint_dirs import ExportRefused
from service.files.checkpoint_tags import MARKER, newest_complete_step, tag
from service.planner.shape import ModelShape

MAX_SHARD_SIZE = "5GB"
"""The export's safetensors files are at most this big by default (`transformers`'
`save_pretrained`'s default, 5 * 10**9 bytes)."""
MIN_SHARD_BYTES = 1 << 10
MAX_SHARD_BYTES = 1 << 40
"""The bounds of `--max-shard-size` (1 KiB to 1 TiB): smaller shards are one file a tensor."""
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
OWNER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""An owner's name as a folder under an export root (users' names are of this form)."""
FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""The name of a file of an export folder (`config.json`, `model-00001-of-00003.safetensors`,
`model.safetensors.index.json`)."""
FIELD = "destination"
"""The request's field that refusals name."""


def shard_bytes(text: str) -> int:
    """A shard size as `transformers`' `save_pretrained(max_shard_size=...)` reads it: a
    number of bytes, or one with a unit (`500MB`, `5GB`: powers of 10; `512MiB`, `5GiB`:
    powers of 2); ValueError saying what is wrong, within MIN_SHARD_BYTES..MAX_SHARD_BYTES."""
    found = _SIZE.fullmatch(text)
    unit = found.group(2).upper() if found else ""
    if not found or unit not in _UNITS:
        raise ValueError(f"{text!r} is no size: give bytes or a number with KB, MB, GB, TB"
                         " (or KiB, MiB, GiB, TiB), e.g. 5GB or 500MB")
    n = int(float(found.group(1)) * _UNITS[unit])
    if not MIN_SHARD_BYTES <= n <= MAX_SHARD_BYTES:
        raise ValueError(f"{text!r} is {n} bytes, outside {MIN_SHARD_BYTES} (1KiB) to"
                         f" {MAX_SHARD_BYTES} (1TiB)")
    return n


class NoCompleteTag(LookupError):
    """The job has no complete tag of the step asked for (or none at all)."""


def complete_step(folder: str, step: int | None, job_id: int) -> int:
    """Step `step` (None: the newest complete one) of the job's checkpoint folder `folder`
    when its tag is complete; else NoCompleteTag."""
    step = step or newest_complete_step(folder)
    if not step or not os.path.exists(os.path.join(folder, tag(step), MARKER)):
        raise NoCompleteTag(f"job {job_id} has no complete checkpoint tag"
                            f" {'of step ' + str(step) if step else 'yet'}")
    return step


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class ExportPlaces:
    """Where an export's folder may be (`Settings.export_root_dirs`), and its default."""

    roots: list[Path]
    data_dir: Path | None = None

    def owner_folders(self, owner: str) -> list[str]:
        """`<root>/<owner>` of every root, real paths."""
        return [os.path.join(os.path.realpath(r), owner) for r in self.roots]

    def refusal(self, raw: str, owner: str) -> str | None:
        """Why the folder `raw` may not be an export of a job `owner` owns; None when it
        may."""
        if not OWNER.fullmatch(owner):
            return f"the job's owner {owner!r} is no folder name under the export roots"
        allowed = ", ".join(f"{f}/<name>" for f in self.owner_folders(owner))
        if not os.path.isabs(raw):
            return f"{raw!r} is not an absolute path; it must lie in {allowed}"
        if "\0" in raw:
            return f"{raw!r} has a NUL character; no path has one"
        if ".." in Path(raw).parts:
            return f"{raw!r} has a '..' part; name the folder itself, in {allowed}"
        real = os.path.realpath(raw)
        if not any(_within(real, f) and real != f for f in self.owner_folders(owner)):
            return (f"{raw!r} resolves to {real}, outside the job owner's folders under the"
                    f" server's export roots (TRIDENT_EXPORT_ROOTS): {allowed}")
        if self.data_dir is not None:
            data = os.path.realpath(self.data_dir)
            if _within(real, data) and not _within(real, os.path.join(data, "exports")):
                return (f"{raw!r} resolves to {real}, inside the data directory {data}, which"
                        " holds Trident's own files")
        if os.path.lexists(real) and (not os.path.isdir(real) or os.listdir(real)):
            return f"{raw!r} exists already and is not an empty folder: name a new one"
        return None

    def default(self, owner: str, job_id: int, step: int) -> str:
        """`<first root>/<owner>/job-<id>-step<N>`, or `...-step<N>-<k>` (k = 2, 3, ...)
        when that is taken; ValueError when the owner's name is no folder name."""
        if not OWNER.fullmatch(owner):
            raise ValueError(f"the job's owner {owner!r} is no folder name under the export"
                             " roots")
        base = os.path.join(self.owner_folders(owner)[0], f"job-{job_id}-step{step}")
        path, k = base, 1
        while os.path.lexists(path):
            k += 1
            path = f"{base}-{k}"
        return path


@dataclass(frozen=True)
class ExportWork:
    """What the task that writes an export is given (JSON-ready: `to_json`)."""

    export_id: int
    job_id: int
    checkpoint_dir: str
    step: int
    shape: dict[str, Any]
    """The model's `ModelShape` fields."""
    destination: str
    max_shard_bytes: int
    node_id: str | None = None
    """Where the job's rank 0 last ran, which wrote the tag's files (None: not known)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, model: ModelSpec, **fields: Any) -> ExportWork:
        """The work of an export of a job whose model is `model` (its shape's fields)."""
        return cls(shape=dataclasses.asdict(ModelShape.from_spec(model)), **fields)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExportWork:
        return cls(**data)

    def memory_bytes(self) -> int:
        """The memory the task holds at most (`workers.checkpoint.hf_weights.write_hf`): one
        shard, at most the model's weights (4 bytes a parameter at most), and twice one tensor
        (the largest, the embedding or the head: made, and the tag's pages it is read from,
        given back once it is made: `workers.checkpoint.mapped`), plus 256 MiB for the
        interpreter and torch."""
        shape = ModelShape.from_fields(self.shape)
        weights = 4 * shape.total_params
        tensor = 4 * shape.vocab * shape.hidden
        return min(self.max_shard_bytes, weights) + 2 * tensor + (256 << 20)


@dataclass(frozen=True)
class ExportDone:
    """What the task gives back: the files written, their bytes, or why it refused."""

    files: list[str] = field(default_factory=list)
    bytes: int = 0
    refused: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def listing(folder: str) -> list[tuple[str, int]]:
    """The files of an export folder (regular files at its top, by name) and their bytes;
    OSError when it cannot be read."""
    out = []
    with os.scandir(folder) as entries:
        for e in entries:
            if FILE.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                out.append((e.name, e.stat(follow_symlinks=False).st_size))
    return sorted(out)


def file_path(folder: str, name: str) -> str | None:
    """The file `name` of the export folder `folder`, confined to it (a name of `FILE`'s
    form, a regular file whose real path is in the folder's); None when there is none."""
    if not FILE.fullmatch(name):
        return None
    real = os.path.realpath(folder)
    path = os.path.realpath(os.path.join(real, name))
    if os.path.dirname(path) != real or not os.path.isfile(path) or os.path.islink(
            os.path.join(real, name)):
        return None
    return path


def run_in_process(work: ExportWork) -> ExportDone:
    """The export written by `python -m workers.checkpoint.hf_export --work JSON`, a process
    of its own on this host (the memory of the tensors it joins is given back when it
    ends); ExportDone with `refused`, or RuntimeError with the end of its output when it
    failed otherwise."""
    run = subprocess.run(
        [sys.executable, "-m", "workers.checkpoint.hf_export", "--work",
         json.dumps(work.to_json())],
        capture_output=True, text=True, check=False)
    lines = run.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if run.returncode == 3 and "refused" in answer:
        return ExportDone(refused=answer["refused"])
    if run.returncode != 0 or "files" not in answer:
        raise RuntimeError(f"the export of {work.checkpoint_dir} step {work.step} failed"
                           f" (exit status {run.returncode}): {run.stderr.strip()[-2000:]}")
    return ExportDone(files=answer["files"], bytes=answer["bytes"])


__all__ = ["MAX_SHARD_SIZE", "ExportDone", "ExportPlaces", "ExportRefused", "ExportWork",
           "NoCompleteTag", "complete_step", "file_path", "listing", "run_in_process",
           "shard_bytes"]
