"""TensorBoard: each job's scalars as event files under `<data_dir>/tensorboard/job-<id>/`.

Written with TensorBoard's own event-file writer (`EventFileWriter`, the one its
`SummaryWriter`s use underneath) and protocol buffers, so the control plane needs neither
torch nor TensorFlow; TensorBoard, and its `EventAccumulator`, read them as they read any run.
A scalar is a `simple_value` (float32, as every TensorBoard scalar), its step the job's step,
its wall time when the step was stored. When a later attempt of a job resumes at step k, a
`SessionLog.START` at k comes first: TensorBoard then shows that attempt's steps from k on in
place of the older attempt's (its "restart" handling), as the job's page does.

One writer per job stays open while the job has steps to come (a writer makes a file of its
own, so a new one each batch would leave thousands); each batch is flushed before its cursor
moves, so what the cursor says was sent is on disk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service.store import Job
from service.store.tracking_exports import Export, Sink
from service.tracking.scalars import StepScalars
from service.tracking.sinks import TrackerDown

MAX_OPEN = 64
"""Writers kept open at once; the least recently used beyond it are closed."""


def job_dir(root: Path | str, job_id: int) -> Path:
    """A job's TensorBoard directory under the root (`<data_dir>/tensorboard`)."""
    return Path(root) / f"job-{job_id}"


class TensorBoardSink:
    """Event files of every job under one root directory."""

    kind = Sink.TENSORBOARD

    def __init__(self, root: Path | str) -> None:
        self.target = str(root)
        self.root = Path(root)
        self._writers: dict[int, Any] = {}

    def _writer(self, job_id: int) -> Any:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if job_id in self._writers:
            self._writers[job_id] = self._writers.pop(job_id)  # most recently used last
            return self._writers[job_id]
        while len(self._writers) >= MAX_OPEN:
            oldest = next(iter(self._writers))
            self._writers.pop(oldest).close()
        path = job_dir(self.root, job_id)
        path.mkdir(parents=True, exist_ok=True)
        writer = EventFileWriter(str(path), filename_suffix=".trident")
        self._writers[job_id] = writer
        return writer

    def open(self, job: Job) -> tuple[str | None, str | None]:
        try:
            job_dir(self.root, job.id).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrackerDown(f"cannot make {job_dir(self.root, job.id)}: {exc}") from exc
        return None, None

    def discard(self, run_id: str) -> None:
        pass

    def summarize(self, job: Job, export: Export, values: dict[str, float]) -> None:
        """Nothing: TensorBoard's scalars are per step; the ledger is the API's and the CLI's
        (`trident goodput`)."""

    def send(self, job: Job, export: Export, steps: Sequence[StepScalars]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary

        try:
            writer = self._writer(job.id)
            attempt = export.attempt
            for s in steps:
                wall = s.time.timestamp()
                if attempt and s.attempt != attempt:
                    writer.add_event(Event(wall_time=wall, step=s.step,
                                           session_log=SessionLog(status=SessionLog.START)))
                attempt = s.attempt
                writer.add_event(Event(wall_time=wall, step=s.step, summary=Summary(value=[
                    Summary.Value(tag=name, simple_value=value)
                    for name, value in sorted(s.values.items())])))
            writer.flush()
        except OSError as exc:  # a full disk: the cursor stays, the batch comes again
            self._drop(job.id)
            raise TrackerDown(f"writing {job_dir(self.root, job.id)}: {exc}") from exc

    def tell(self, job: Job, export: Export, *, final: bool) -> None:
        if final:
            self._drop(job.id)

    def _drop(self, job_id: int) -> None:
        writer = self._writers.pop(job_id, None)
        if writer is not None:
            with contextlib.suppress(OSError):  # what it did not flush comes again
                writer.close()

    def close(self) -> None:
        for job_id in list(self._writers):
            self._drop(job_id)
