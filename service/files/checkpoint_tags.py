"""A checkpoint tag on disk: its folder's name (`step<N>/`), whether it is complete, what it
holds, and its `COMPLETE` marker with the size and SHA-256 of every file of the tag.

The ranks write the marker when they save a tag and check it before they resume
(`workers.checkpoint.saving`); the controller lists the complete tags of a job's folder
(`service.control.tag_recovery`), the export reads the newest (`service.files.export`), a seeded
tag takes its source's marker (`service.files.checkpoint_dirs.seed`). Whose folder holds the tags is
`service.files.checkpoint_dirs`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

from service.contract.specfiles import FileRefused, read_regular

TAG = re.compile(r"^step(\d+)$")
"""A tag's folder name (`step<N>/`); its group: the step."""


def tag(step: int) -> str:
    """Tag `step`'s folder name."""
    return f"step{step}"


def newest_complete_step(directory: str | Path | None) -> int:
    """The step of the newest complete checkpoint under `directory`, 0 when there is none."""
    if not directory or not os.path.isdir(directory):
        return 0
    return max(complete_steps(directory), default=0)


def complete_steps(directory: str | Path) -> list[int]:
    """The steps of the complete tags under `directory`, oldest first (none when it does not
    exist); OSError when it cannot be listed."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(directory) if (m := TAG.match(name))
                  and os.path.exists(os.path.join(directory, name, MARKER)))


def tree_bytes(path: str | Path) -> int:
    """Bytes of the files under `path` (what it holds on disk, to within block rounding)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # gone meanwhile
                total += os.lstat(os.path.join(root, name)).st_size
    return total


MARKER = "COMPLETE"
"""The file that makes a tag complete (`workers.checkpoint.saving`): written last, by rank 0. It
holds the tag's step and every other file's size and SHA-256 (`marker_text`); a marker of
before checksums holds the step alone."""


DAMAGED = MARKER + ".damaged"
"""What a tag's marker is renamed to when its files no longer match it: the tag is partial
from then on (never resumed from, pruned as a partial tag), its record kept to look at."""


MARKER_MAX_BYTES = 64 << 20
"""The most bytes of a marker read (some 100 bytes per file of the tag)."""


CHUNK = 1 << 20
"""Bytes read at a time when a file is hashed: memory stays bounded whatever its size."""


Digests = dict[str, tuple[int, str]]
"""A tag's files by path inside it: (bytes, SHA-256 in hex)."""


def file_digest(path: str | Path) -> tuple[int, str]:
    """(bytes, SHA-256 in hex) of the file, read `CHUNK` bytes at a time."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def tag_files(tag_path: str | Path) -> list[str]:
    """Every file of a tag, by path inside it, its marker aside."""
    out = []
    for root, _dirs, files in os.walk(tag_path):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), tag_path)
            if rel not in (MARKER, MARKER + ".tmp", DAMAGED):
                out.append(rel)
    return sorted(out)


def marker_text(step: int, digests: Digests) -> str:
    """A marker's content: the step and each file's size and SHA-256 (`recorded` reads it)."""
    files = {rel: {"bytes": n, "sha256": d} for rel, (n, d) in sorted(digests.items())}
    return json.dumps({"step": step, "files": files}) + "\n"


def recorded(tag_path: str | Path) -> Digests | None:
    """The files and checksums tag's marker records; None for a marker of before checksums
    (the step alone: such a tag loads unchecked). ValueError when the marker cannot be read
    or is not one Trident wrote."""
    path = os.path.join(tag_path, MARKER)
    try:
        raw = read_regular(path, MARKER_MAX_BYTES)
        data = json.loads(raw)
    except (OSError, FileRefused, ValueError, RecursionError) as exc:
        raise ValueError(f"its {MARKER} marker cannot be read ({exc})") from None
    if type(data) is int:
        return None
    try:
        return {str(rel): (int(f["bytes"]), str(f["sha256"])) for rel, f in data["files"].items()}
    except (TypeError, KeyError, AttributeError, ValueError):
        raise ValueError(f"its {MARKER} marker is not one Trident wrote") from None


def mismatch(tag_path: str | Path, rel: str, size: int, digest: str) -> str | None:
    """How file `rel` of a tag differs from what its marker records; None when it is the
    same (its size first: a file cut short is told without reading it)."""
    path = os.path.join(tag_path, rel)
    try:
        now = os.stat(path).st_size
        if now != size:
            return f"{rel} has {now} bytes, {size} recorded"
        if file_digest(path)[1] != digest:
            return f"{rel}: its SHA-256 differs from the one recorded ({size} bytes)"
    except OSError as exc:
        return f"{rel} cannot be read ({type(exc).__name__}: {exc.strerror or exc})"
    return None
