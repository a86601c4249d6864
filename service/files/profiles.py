"""Where `trident profile`'s traces are stored: `<data_dir>/profiles/job-<id>/request-<n>/`.

The controller writes them (`service.control.profile_collect`), the API streams them back.
Every path is built from integers and from file names that match `NAME`, so none leaves
the root; a name the ranks send that does not match is not written.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

NAME = re.compile(r"rank-[0-9]{1,6}\.[a-z0-9][a-z0-9.-]{0,63}")
"""A trace file's name (`workers.monitor.profiler`): `rank-<r>.<what>`."""


def profile_root(data_dir: Path) -> Path:
    """The server's traces, under its data directory."""
    return data_dir / "profiles"


class ProfileFiles:
    """The trace files of every job's profile requests, under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def folder(self, job_id: int, request_id: int) -> Path:
        return self.root / f"job-{int(job_id)}" / f"request-{int(request_id)}"

    def path(self, job_id: int, request_id: int, name: str) -> Path | None:
        """A stored file of a request, or None (an unknown name, or no such file)."""
        if not NAME.fullmatch(name):
            return None
        path = self.folder(job_id, request_id) / name
        return path if path.is_file() else None

    def write(self, job_id: int, request_id: int, name: str, data: bytes) -> None:
        """Written whole or not at all (a temporary file renamed)."""
        if not NAME.fullmatch(name):
            raise ValueError(f"not a trace file's name: {name[:80]!r}")
        folder = self.folder(job_id, request_id)
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / f".{name}.part"
        part.write_bytes(data)
        part.replace(folder / name)

    def remove(self, job_id: int, request_id: int) -> None:
        shutil.rmtree(self.folder(job_id, request_id), ignore_errors=True)

    def prune(self, job_id: int, keep: set[int]) -> None:
        """Remove the folders of the job's requests not in `keep` (requests no longer
        stored)."""
        job = self.root / f"job-{int(job_id)}"
        if not job.is_dir():
            return
        for folder in job.iterdir():
            name = folder.name
            if name.startswith("request-") and name[8:].isdigit() and int(name[8:]) not in keep:
                shutil.rmtree(folder, ignore_errors=True)
