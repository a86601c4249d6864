"""The step reports a checkpoint tag carries: what each rank had not had acknowledged when it
saved the tag.

A rank keeps its step reports until the controller says it stored them (`workers.rank.actor`,
`poll(ack)`). When an attempt ends by a node's death, a partition, a preemption cut short or
the controller's `kill -9`, the reports not polled yet die with the ranks, while the tags they
saved already hold those steps. So each rank writes, inside every tag it saves and before
rank 0 marks it complete (`workers.checkpoint.saving.save`), the reports it holds unacknowledged,
the tag's own step among them: `<tag>/trident-steps/rank<r>.json` (`write`). A complete tag
therefore holds, rank by rank, every step report up to its step that the store may lack, and
the controller stores them before any attempt resumes from it (`service.control.tag_recovery`, which
reads them with `read`).

The file names the job and attempt that wrote it: a report from a tag is stored under the
attempt that ran the step, where the store keeps one per (job, attempt, step, rank), so one
also polled, or read from two tags, is stored once; a tag copied from another job
(`checkpoint.resume_from`) brings no reports of that job into this one.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS_DIR = "trident-steps"
"""A tag's folder of step reports, one file per rank (`rank<r>.json`)."""


def steps_file(tag_path: str | Path, rank: int) -> Path:
    return Path(tag_path) / STEPS_DIR / f"rank{rank}.json"


def write(tag_path: str | Path, *, job_id: int | None, attempt: int, world_size: int,
          rank: int, reports: list[dict[str, Any]]) -> None:
    """Rank `rank`'s unacknowledged step `reports` (`StepReport.model_dump()`), into the tag
    at `tag_path` (whole or not at all: a temporary file renamed). `job_id` None: a run without
    a controller, whose reports no job takes."""
    path = steps_file(tag_path, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump({"job_id": job_id, "attempt": attempt, "world_size": world_size,
                   "rank": rank, "reports": reports}, f)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Carried:
    """One rank's file of a tag, as `read` found it."""

    rank: int
    attempt: int
    world_size: int
    reports: list[dict[str, Any]]


def read(tag_path: str | Path, *, job_id: int,
         max_bytes: int) -> tuple[list[Carried], list[str]]:
    """The files of the tag at `tag_path` that job `job_id` wrote, by rank; and why each other
    file was passed over (larger than `max_bytes`, unreadable, not one a rank wrote). Files of
    another job (a tag copied from it) are passed over without a word."""
    folder = Path(tag_path) / STEPS_DIR
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except OSError:
        return [], []  # a tag saved without reports (a custom entrypoint, an older Trident)
    found: list[Carried] = []
    skipped: list[str] = []
    for name in names:
        try:
            carried = _one(folder / name, job_id, max_bytes)
        except (OSError, ValueError) as exc:  # JSON's errors are ValueErrors too
            skipped.append(f"{folder / name}: {exc}")
            continue
        if carried is not None:
            found.append(carried)
    return found, skipped


def _one(path: Path, job_id: int, max_bytes: int) -> Carried | None:
    # Opened without blocking and checked regular before a byte is read: a FIFO put there
    # must not hold the controller's pass.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes (TRIDENT_TAG_STEPS_MAX_BYTES)")
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("job_id") != job_id:
        return None
    rank, attempt, world = data.get("rank"), data.get("attempt"), data.get("world_size")
    reports = data.get("reports")
    if not all(type(v) is int for v in (rank, attempt, world)) or not isinstance(reports, list):
        raise ValueError("it names no rank, attempt, world_size and reports")
    assert isinstance(rank, int) and isinstance(attempt, int) and isinstance(world, int)
    if path.name != f"rank{rank}.json" or not 0 <= rank < world or attempt < 1:
        raise ValueError(f"rank {rank} of {world}, attempt {attempt}: not a file a rank wrote")
    return Carried(rank=rank, attempt=attempt, world_size=world,
                   reports=[r for r in reports if isinstance(r, dict)])
