"""A job's checkpoint tag as a tar of a Hugging Face model folder, for the API's
`GET /jobs/{id}/export`: which tag (the one asked for, or the newest complete one), the
folder written under the server's data directory, and the tar streamed from its files.

The conversion itself (reading DeepSpeed's files with torch, joining shards, stages and
ZeRO-3 partitions) is the ranks' package's (`workers.checkpoint.hf_export`), run here as a process
of its
own (`python -m workers.checkpoint.hf_export`): the service never imports `workers` or torch, and
the memory a large model's tensors take while they are joined is given back when that process
ends, not kept by the API process.

Exports take slots: at most `Settings.export_max_concurrent` run at once over every API
process of a data directory. Slot i is an exclusive `flock` on `<data_dir>/exports/slot-<i>.lock`
and its folder `<data_dir>/exports/slot-<i>/`, held from the conversion until the tar is sent
(or the client is gone). The kernel drops the lock with its process, `kill -9` included, so a
folder whose slot nobody holds is stale: `sweep` (every API process's start) removes it, and
so does the next export that takes its slot.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from service.files.checkpoint_dirs import ExportRefused
from service.files.checkpoint_tags import MARKER, newest_complete_step, tag
from service.files.datadir import try_lock
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
EXPORTS = "exports"
"""The folder of the data directory that exports write in."""
CHUNK = 1 << 20
"""The tar is sent in pieces of this many bytes of a file."""
_SLOT = re.compile(r"slot-(\d+)")


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


class ExportsBusy(Exception):
    """Every export slot is taken."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"{limit} export(s) are running on this server, the most it runs at"
                         " once (TRIDENT_EXPORT_MAX_CONCURRENT); try again when one is done")


class Slot:
    """An export slot held: its lock's descriptor and its folder `work` (emptied when taken).
    `release` (idempotent, from any thread) deletes the folder and drops the lock."""

    def __init__(self, fd: int, work: Path) -> None:
        self.fd, self.work = fd, work
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self.fd < 0:
                return
            shutil.rmtree(self.work, ignore_errors=True)
            os.close(self.fd)
            self.fd = -1


def take_slot(data_dir: Path, limit: int) -> Slot:
    """The first free of `limit` export slots, its folder made empty; ExportsBusy when
    every one is held."""
    root = data_dir / EXPORTS
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for i in range(limit):
        fd = try_lock(root / f"slot-{i}.lock")
        if fd is None:
            continue
        work = root / f"slot-{i}"
        shutil.rmtree(work, ignore_errors=True)  # a killed export's leftovers
        try:
            work.mkdir(mode=0o700)
        except BaseException:
            os.close(fd)
            raise
        return Slot(fd, work)
    raise ExportsBusy(limit)


def sweep(data_dir: Path) -> list[str]:
    """Remove what exports that ended without cleaning up (their process killed) left under
    `<data_dir>/exports/`: every folder whose slot no process holds, whatever the number of
    slots now. The names removed."""
    root = data_dir / EXPORTS
    removed: list[str] = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return removed
    for name in names:
        if name.endswith(".lock"):
            continue
        m = _SLOT.fullmatch(name)
        fd = try_lock(root / f"{name}.lock") if m else None
        if m and fd is None:
            continue  # an export in progress in another API process
        try:
            path = root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(name)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


@dataclass(frozen=True)
class Exported:
    """A tag exported: the folder `path` (inside a slot's folder), sent as `filename`."""

    path: Path
    filename: str
    step: int


def complete_step(folder: str, step: int | None, job_id: int) -> int:
    """Step `step` (None: the newest complete one) of the job's checkpoint folder `folder`
    when its tag is complete; else NoCompleteTag."""
    step = step or newest_complete_step(folder)
    if not step or not os.path.exists(os.path.join(folder, tag(step), MARKER)):
        raise NoCompleteTag(f"job {job_id} has no complete checkpoint tag"
                            f" {'of step ' + str(step) if step else 'yet'}")
    return step


def export_folder(folder: str, step: int, shape: ModelShape, job_id: int, slot: Slot,
                  max_shard_bytes: int) -> Exported:
    """Tag `step` (complete: `complete_step`) of the job's checkpoint folder `folder` written
    as the folder `job-<id>-step<N>-hf/` (`config.json`, safetensors in shards of at most
    `max_shard_bytes`: `shard_bytes`) inside the slot's folder;
    `service.files.checkpoint_dirs.ExportRefused` when its layout or model is not
    exported."""
    name = f"job-{job_id}-step{step}-hf"
    _convert(folder, step, shape, str(slot.work / name), max_shard_bytes, slot.fd)
    return Exported(path=slot.work / name, filename=name + ".tar", step=step)


def tar_stream(path: Path) -> tuple[int, Iterator[bytes]]:
    """The folder `path` (regular files only, no subfolders: an export's) as a tar whose top
    folder is its name: its length in bytes and its pieces, read from the files as they are
    sent (never the whole tar in memory or on disk)."""
    headers: list[tuple[bytes, Path, int]] = []
    top = tarfile.TarInfo(path.name)
    top.type, top.mode = tarfile.DIRTYPE, 0o755
    for f in sorted(path.iterdir()):
        info = tarfile.TarInfo(f"{path.name}/{f.name}")
        info.size, info.mode = f.stat().st_size, 0o644
        headers.append((info.tobuf(tarfile.PAX_FORMAT), f, info.size))
    first = top.tobuf(tarfile.PAX_FORMAT)
    end = b"\0" * (2 * tarfile.BLOCKSIZE)
    length = len(first) + len(end) + sum(len(h) + _padded(n) for h, _, n in headers)

    def pieces() -> Iterator[bytes]:
        yield first
        for header, f, size in headers:
            yield header
            sent = 0
            with f.open("rb") as src:
                while piece := src.read(min(CHUNK, size - sent)):
                    sent += len(piece)
                    yield piece
            if sent != size:
                raise OSError(f"{f} changed size while it was sent")
            yield b"\0" * (_padded(size) - size)
        yield end

    return length, pieces()


def _padded(size: int) -> int:
    """`size` rounded up to tar's block."""
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def _convert(folder: str, step: int, shape: ModelShape, out: str, max_shard_bytes: int,
             lock_fd: int) -> None:
    """`workers.checkpoint.hf_export` in a process of its own; ExportRefused with its reason, or
    RuntimeError with the end of its output when it failed otherwise. The process holds the
    slot's lock too (`lock_fd`, inherited) and ends itself when this one ends (`--parent`):
    a killed API process's conversion neither writes on after it nor has its folder swept
    while it still writes."""
    run = subprocess.run(
        [sys.executable, "-m", "workers.checkpoint.hf_export", folder, str(step), out,
         "--shape", json.dumps(dataclasses.asdict(shape)),
         "--max-shard-bytes", str(max_shard_bytes), "--parent", str(os.getpid())],
        capture_output=True, text=True, check=False, pass_fds=(lock_fd,))
    lines = run.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if run.returncode == 3 and "refused" in answer:
        raise ExportRefused(answer["refused"])
    if run.returncode != 0 or "files" not in answer:
        raise RuntimeError(f"the export of {folder} step {step} failed (exit status"
                           f" {run.returncode}): {run.stderr.strip()[-2000:]}")

