"""Each job's checkpoint tags as its ranks reported them: step, size, layout, time, and which
ones retention deleted.

Rank 0 reports with a step's report the tag it completed (`StepReport.checkpoint`,
`checkpoint_bytes`) and the older tags it deleted then (`checkpoints_removed`, by the policy
`checkpoint.keep_last` / `keep_every`, see `workers.checkpoint.saving.prune`); the controller stores
both here (`service.control.worker_reports`). A report sent again (a poll not acknowledged) writes
the same row again. The tags of a folder that no stored report named (rank 0's report died with
its attempt), and those deleted unreported, are added and marked removed from the disk
(`service.control.tag_recovery`). The bytes on disk of a job are the sum over its tags not removed:
what
`trident checkpoints JOB`, `GET /api/v1/jobs/{id}/checkpoints` and `describe` show.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.store.engine import EngineTx
from service.store.store import Store
from service.store.tables import CheckpointRow, utcnow
from service.store.views import aware


@dataclass(frozen=True)
class Checkpoint:
    job_id: int
    step: int
    attempt: int
    bytes: int
    layout: dict[str, Any]
    created_at: datetime
    removed_at: datetime | None

    @classmethod
    def from_row(cls, row: CheckpointRow) -> Checkpoint:
        created = aware(row.created_at)
        assert created is not None
        return cls(job_id=row.job_id, step=row.step, attempt=row.attempt, bytes=row.bytes,
                   layout=dict(row.layout or {}), created_at=created,
                   removed_at=aware(row.removed_at))

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "attempt": self.attempt, "bytes": self.bytes,
                "layout": self.layout, "created_at": self.created_at.isoformat(),
                "removed_at": self.removed_at.isoformat() if self.removed_at else None}


class CheckpointIndex(EngineTx):
    """The `checkpoints` table, on the store's transactions (one per call)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)

    def saved(self, *, job_id: int, attempt: int, step: int, size: int,
              layout: dict[str, Any], removed: list[int] | None = None) -> None:
        """Tag `step` is complete (`size` bytes, written by `layout`); the tags of `removed`
        were deleted after it."""
        with self._tx() as s:
            row = s.get(CheckpointRow, (job_id, step))
            if row is None:
                s.add(CheckpointRow(job_id=job_id, step=step, attempt=attempt, bytes=size,
                                    layout=layout, created_at=utcnow()))
            elif row.attempt != attempt or row.removed_at is not None:  # saved again
                row.attempt, row.bytes, row.layout = attempt, size, layout
                row.created_at, row.removed_at = utcnow(), None
            if removed:
                _remove(s, job_id, removed)

    def gone(self, *, job_id: int, steps: list[int]) -> None:
        """The tags of `steps` are no longer on disk (`service.control.tag_recovery`): removed."""
        with self._tx() as s:
            _remove(s, job_id, steps)

    def list(self, *, job_id: int, removed: bool = False) -> list[Checkpoint]:
        """The job's tags by step (with `removed`, the deleted ones too)."""
        with self._tx() as s:
            q = select(CheckpointRow).where(CheckpointRow.job_id == job_id)
            if not removed:
                q = q.where(CheckpointRow.removed_at.is_(None))
            return [Checkpoint.from_row(r)
                    for r in s.execute(q.order_by(CheckpointRow.step)).scalars()]

    def bytes_on_disk(self, *, job_id: int) -> int:
        with self._tx() as s:
            total = s.execute(select(func.sum(CheckpointRow.bytes))
                              .where(CheckpointRow.job_id == job_id,
                                     CheckpointRow.removed_at.is_(None))).scalar()
            return int(total or 0)


def _remove(s: Session, job_id: int, steps: list[int]) -> None:
    s.execute(update(CheckpointRow)
              .where(CheckpointRow.job_id == job_id, CheckpointRow.step.in_(steps),
                     CheckpointRow.removed_at.is_(None))
              .values(removed_at=utcnow()))
