"""The controller's side of `trident export`: each export the API stored
(`service.store.exports`) runs as a task on the cluster, beside the loop.

Each pass, `ExportRunner.step` stores what the tasks that ended gave back (the folder's files
and bytes, or why not) and starts the pending exports, at most `limit` at once
(`Settings.export_max_concurrent`), each on a thread of its own that waits for its task: the
task is `run` (on Ray, `workers.launch.export_task.ray_export`: a Ray task that requests the
memory of one shard and one tensor, `ExportWork.memory_bytes`, placed by preference on the
node where the job's rank 0 last ran, which wrote the tag; elsewhere the tag must be on
storage every node reads). An export a previous controller took but never finished (it stopped
meanwhile, and its task with it) is failed with the reason: asking again starts it anew.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from service.files.export import ExportDone, ExportWork
from service.store.exports import ExportRecords
from service.store.store import Store
from service.store.views import NotFound

ERROR_MAX = 4000
"""The most characters of a failed export's reason stored."""


class ExportRunner:
    """The exports' tasks, started and collected beside the controller's loop."""

    def __init__(self, store: Store, run: Callable[[ExportWork], ExportDone],
                 limit: int = 2) -> None:
        self.store, self.run, self.limit = store, run, limit
        self.records = ExportRecords(store)
        self._running: dict[int, Future[ExportDone]] = {}
        self._pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="export")

    @property
    def pending(self) -> bool:
        """Whether a task of this runner's is running."""
        return bool(self._running)

    def step(self) -> None:
        for export_id, future in list(self._running.items()):
            if future.done():
                del self._running[export_id]
                self._store(export_id, future)
        for rec in self.records.open():
            if rec.id in self._running:
                continue
            if rec.state == "running":
                self.records.finish(rec.id, error="the controller that ran this export"
                                    " stopped before it ended; ask for it again")
                continue
            if len(self._running) >= self.limit:
                break
            try:
                work = self.work(rec.id, rec.job_id, rec.step, rec.destination,
                                 rec.max_shard_bytes)
            except (NotFound, ValueError) as exc:
                self.records.finish(rec.id, error=str(exc)[:ERROR_MAX])
                continue
            self.records.take(rec.id)
            self._running[rec.id] = self._pool.submit(self.run, work)

    def work(self, export_id: int, job_id: int, step: int, destination: str,
             max_shard_bytes: int) -> ExportWork:
        """What the export's task is given: the job's model and checkpoint folder, and the
        node its rank 0 last ran on."""
        job = self.store.get_job(job_id=job_id)
        node = None
        for attempt in reversed(self.store.list_attempts(job_id=job_id)):
            ranks = (attempt.placement or {}).get("ranks") or []
            if ranks and isinstance(ranks[0], dict) and ranks[0].get("node_id"):
                node = str(ranks[0]["node_id"])
                break
        return ExportWork.of(job.spec.planned_model, export_id=export_id, job_id=job_id,
                             checkpoint_dir=self.records.checkpoint_dir(export_id), step=step,
                             destination=destination, max_shard_bytes=max_shard_bytes,
                             node_id=node)

    def _store(self, export_id: int, future: Future[ExportDone]) -> None:
        try:
            done = future.result()
        except Exception as exc:  # the task's error, as data
            self.records.finish(export_id, error=f"{type(exc).__name__}: {exc}"[-ERROR_MAX:])
            return
        if done.refused is not None:
            self.records.finish(export_id, error=done.refused[:ERROR_MAX])
        else:
            self.records.finish(export_id, files=done.files, size=done.bytes)

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for the running tasks (at most `timeout_s` each) and store what they gave
        back (tests, and a controller that stops)."""
        for export_id, future in list(self._running.items()):
            with contextlib.suppress(Exception):  # stored by `_store`
                future.result(timeout=timeout_s)
            if future.done():
                del self._running[export_id]
                self._store(export_id, future)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
