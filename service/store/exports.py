"""The `exports` table (migration 0023): the exports `trident export` asked for, made by the
API, taken and finished by the controller (`service.control.export_run`), listed by
`GET /jobs/{id}/exports`. Kept as long as the job is (they say where each export went).
"""

from __future__ import annotations

from sqlalchemy import select

from client.payloads import ExportRecord, ExportState
from service.store.engine import EngineTx
from service.store.tables import ExportRow, utcnow
from service.store.views import NotFound, aware

OPEN = (ExportState.PENDING.value, ExportState.RUNNING.value)


def record_of(r: ExportRow) -> ExportRecord:
    return ExportRecord(id=r.id, job_id=r.job_id, step=r.step, state=ExportState(r.state),
                        destination=r.destination, max_shard_bytes=r.max_shard_bytes,
                        requested_by=r.requested_by, files=list(r.files or []), bytes=r.bytes,
                        error=r.error, created_at=aware(r.created_at) or r.created_at,
                        finished_at=aware(r.finished_at))


class ExportRecords(EngineTx):
    """Queries of the `exports` table."""

    def create(self, *, job_id: int, step: int, destination: str, checkpoint_dir: str,
               max_shard_bytes: int, requested_by: str | None) -> ExportRecord:
        """A pending export."""
        with self._tx() as s:
            row = ExportRow(job_id=job_id, step=step, state=ExportState.PENDING.value,
                            destination=destination, checkpoint_dir=checkpoint_dir,
                            max_shard_bytes=max_shard_bytes, requested_by=requested_by,
                            files=[])
            s.add(row)
            s.flush()
            return record_of(row)

    def get(self, *, job_id: int, export_id: int) -> ExportRecord:
        with self._tx() as s:
            row = s.get(ExportRow, export_id)
            if row is None or row.job_id != job_id:
                raise NotFound(f"export {export_id} of job {job_id} not found")
            return record_of(row)

    def of_job(self, job_id: int) -> list[ExportRecord]:
        """The job's exports, newest first."""
        with self._tx() as s:
            rows = s.execute(select(ExportRow).where(ExportRow.job_id == job_id)
                             .order_by(ExportRow.id.desc())).scalars()
            return [record_of(r) for r in rows]

    def checkpoint_dir(self, export_id: int) -> str:
        with self._tx() as s:
            row = s.get(ExportRow, export_id)
            if row is None:
                raise NotFound(f"export {export_id} not found")
            return row.checkpoint_dir

    def open(self) -> list[ExportRecord]:
        """Every export not finished, oldest first."""
        with self._tx() as s:
            rows = s.execute(select(ExportRow).where(ExportRow.state.in_(OPEN))
                             .order_by(ExportRow.id)).scalars()
            return [record_of(r) for r in rows]

    def take(self, export_id: int) -> None:
        """The controller started its task."""
        with self._tx() as s:
            row = s.get(ExportRow, export_id)
            if row is not None:
                row.state = ExportState.RUNNING.value

    def finish(self, export_id: int, *, files: list[str] | None = None, size: int | None = None,
               error: str | None = None) -> None:
        """Done (`files`, `size`), or failed (`error`)."""
        with self._tx() as s:
            row = s.get(ExportRow, export_id)
            if row is not None:
                row.state = (ExportState.FAILED if error else ExportState.DONE).value
                row.files, row.bytes, row.error = files or [], size, error
                row.finished_at = utcnow()
