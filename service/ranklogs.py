"""Reading rank logs (written by `workers.ranklog`) for the API: by job, attempt and rank.

A rank's log is one byte stream, kept as `rank-<r>.log` (from the offset in
`rank-<r>.log.base`) and, after a rotation, `rank-<r>.log.1` (the bytes just before it).
Readers ask for the bytes from a stream offset (`since`) and get the next offset back, so that
a follower sees every byte once, across rotations; bytes rotated out before being read are
counted as `skipped`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def rank_log_path(log_dir: str | Path, rank: int) -> Path:
    """A rank's log file in its attempt's log directory (written by `workers.ranklog`)."""
    return Path(log_dir) / f"rank-{rank}.log"


def attempt_log_dir(root: Path, job_id: int, attempt: int) -> Path:
    """`<root>/job-<id>/attempt-<n>`: built from integers only, so it stays under `root`."""
    return root / f"job-{int(job_id)}" / f"attempt-{int(attempt)}"


@dataclass(frozen=True)
class Chunk:
    rank: int
    text: str
    next: int
    """The offset to ask for next (`since`)."""
    skipped: int
    """Bytes between `since` and the first byte returned that the cap rotated away."""
    size: int
    """The stream's length so far (bytes written by the rank, including rotated ones)."""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _base(path: Path) -> int:
    try:
        return int(path.with_name(path.name + ".base").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _read_at(path: Path, offset: int, n: int) -> bytes:
    if n <= 0:
        return b""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(n)
    except FileNotFoundError:
        return b""


def read_chunk(log_dir: Path, rank: int, since: int, max_bytes: int) -> Chunk:
    """At most `max_bytes` of `rank`'s stream from offset `since`, cut after the last whole
    line when there is more to read (so that a multi-byte character is never split)."""
    path = rank_log_path(log_dir, rank)
    old = path.with_name(path.name + ".1")
    for _ in range(3):  # a rotation between reading the offset and the files: read again
        base = _base(path)
        cur, prev = _size(path), _size(old)
        lo, end = base - prev, base + cur
        start = min(max(since, lo), end)
        skipped = max(0, lo - since)
        data = b""
        if start < base:
            data = _read_at(old, start - lo, min(base - start, max_bytes))
        if len(data) < max_bytes and start + len(data) >= base:
            data += _read_at(path, start + len(data) - base, max_bytes - len(data))
        if _base(path) == base:
            break
    more = start + len(data) < end
    if more and b"\n" in data:
        data = data[:data.rindex(b"\n") + 1]
    return Chunk(rank=rank, text=data.decode("utf-8", errors="replace"),
                 next=start + len(data), skipped=skipped, size=end)
