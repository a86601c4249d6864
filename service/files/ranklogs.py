"""Reading rank logs (written by `workers.runtime.ranklog`) for the API: by job, attempt and rank.

A rank's log is one byte stream, kept as `rank-<r>.log` (from the offset in
`rank-<r>.log.base`) and, after a rotation, `rank-<r>.log.1` (the bytes just before it).
Readers ask for the bytes from a stream offset (`since`) and get the next offset back, so that
a follower sees every byte once, across rotations; bytes rotated out before being read are
counted as `skipped`.

The writer's time index (`rank-<r>.log.times`, `.times.1`: `<unix time> <offset>` lines, see
`workers.runtime.ranklog`) gives each line the time by which it was written (`times`), and a time
the offset from which to read (`offset_at`).
"""

from __future__ import annotations

import bisect
from dataclasses import replace
from pathlib import Path

from client.payloads import Chunk


def rank_log_path(log_dir: str | Path, rank: int) -> Path:
    """A rank's log file in its attempt's log directory (written by `workers.runtime.ranklog`)."""
    return Path(log_dir) / f"rank-{rank}.log"


def attempt_log_dir(root: Path, job_id: int, attempt: int) -> Path:
    """`<root>/job-<id>/attempt-<n>`: built from integers only, so it stays under `root`."""
    return root / f"job-{int(job_id)}" / f"attempt-{int(attempt)}"


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


def _read(log_dir: Path, rank: int, since: int, max_bytes: int
          ) -> tuple[bytes, int, int, int, int]:
    """At most `max_bytes` raw bytes from offset `since`: the bytes, where they start, the
    bytes skipped before them, the lowest offset still kept, and the stream's end."""
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
    return data, start, skipped, lo, end


def read_chunk(log_dir: Path, rank: int, since: int, max_bytes: int) -> Chunk:
    """At most `max_bytes` of `rank`'s stream from offset `since`, cut after the last whole
    line when there is more to read (so that a multi-byte character is never split)."""
    data, start, skipped, _, end = _read(log_dir, rank, since, max_bytes)
    more = start + len(data) < end
    if more and b"\n" in data:
        data = data[:data.rindex(b"\n") + 1]
    return Chunk(rank=rank, text=data.decode("utf-8", errors="replace"),
                 next=start + len(data), skipped=skipped, size=end)


def tail_offset(log_dir: Path, rank: int, lines: int, max_bytes: int) -> int:
    """Where the last `lines` lines of `rank`'s stream start, looking back at most
    `max_bytes` (then from the first whole line in them)."""
    _, _, _, _, end = _read(log_dir, rank, 2**62, 0)
    data, start, _, lo, _ = _read(log_dir, rank, max(0, end - max_bytes), max_bytes)
    pos = len(data) - 1 if data.endswith(b"\n") else len(data)
    for _ in range(lines):
        nl = data.rfind(b"\n", 0, pos)
        if nl < 0:  # fewer lines than asked in the window
            if start == lo or b"\n" not in data:
                return start
            return start + data.index(b"\n") + 1  # the window's first line may be cut
        pos = nl
    return start + pos + 1


def time_index(log_dir: Path, rank: int) -> list[tuple[float, int]]:
    """The writer's `(time, offset)` samples, oldest first: bytes before `offset` were
    written by `time`."""
    path = rank_log_path(log_dir, rank)
    out: list[tuple[float, int]] = []
    for p in (path.with_name(path.name + ".times.1"), path.with_name(path.name + ".times")):
        try:
            text = p.read_text()
        except (FileNotFoundError, UnicodeDecodeError):
            continue
        for line in text.splitlines():
            t, _, off = line.partition(" ")
            try:
                out.append((float(t), int(off)))
            except ValueError:  # a line being written
                continue
    return out


def offset_at(log_dir: Path, rank: int, when: float) -> int:
    """Where the output written at or after unix time `when` starts (to within the writer's
    sampling interval): the offset of the last sample taken before `when`; the stream's
    end when nothing was written since."""
    path = rank_log_path(log_dir, rank)
    if path.exists() and path.stat().st_mtime < when:
        return _read(log_dir, rank, 2**62, 0)[4]
    index = time_index(log_dir, rank)
    i = bisect.bisect_left([t for t, _ in index], when)
    return index[i - 1][1] if i else 0


def with_times(log_dir: Path, chunk: Chunk) -> Chunk:
    """`chunk` with the time of each of its lines: the first sample at or past the line's
    end; for output newer than every sample, the log file's last modification."""
    index = time_index(log_dir, chunk.rank)
    offsets = [o for _, o in index]
    try:
        newest = rank_log_path(log_dir, chunk.rank).stat().st_mtime
    except FileNotFoundError:
        newest = index[-1][0] if index else 0.0
    times: list[float] = []
    raw = chunk.text.encode("utf-8", errors="replace")
    pos = chunk.next - len(raw)
    for line in raw.split(b"\n")[:-1] if raw.endswith(b"\n") else raw.split(b"\n"):
        pos += len(line) + 1
        i = bisect.bisect_left(offsets, min(pos, chunk.next))
        times.append(index[i][0] if i < len(index) else newest)
    return replace(chunk, times=times if raw else [])
