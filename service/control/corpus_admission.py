"""Corpora scanned before admission: a queued job whose corpus no record describes waits in
the queue while the controller scans it, beside the loop, and fails when a token id is out of
its vocabulary, before any rank starts.

A submission reads no `.bin` larger than `service.files.corpus_scan.INLINE_BYTES`: the
corpus's largest token id comes from its `PREFIX.meta.json` (written by `trident data
prepare`) or from the data directory's record of an earlier scan. A corpus with neither (one
prepared by Megatron's own tool, never inspected with `trident data inspect --index`) is
accepted, and scanned here once: one corpus at a time, in a thread of its own, so a pass never
waits on it; the result is recorded under the data directory (`<data_dir>/corpus-scans/`),
keyed by the files' fingerprint, so no later job scans it again. Until its scans are done a
job stays queued and the jobs behind it are admitted as if it were not there; once they are
done it is admitted as any job, or FAILED with `data.train.<i>.path: <file>: token id ... is at
or above the model's vocabulary model.vocab(...)` (no retry: the corpus would not change). A
corpus that changed since it was checked at submission (`service.files.data_check.changed`)
is not scanned: the job is admitted, and its rank 0 fails it saying so (`workers.trainer.data`).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from service.contract.spec import JobSpec
from service.files import corpus, corpus_scan
from service.files.data_check import changed
from service.store import Job

log = logging.getLogger(__name__)

READY = "ready"
SCANNING = "scanning"


class CorpusAdmission:
    """Which queued jobs' corpora are known to fit their vocabulary; scans the others."""

    def __init__(self, data_dir: Path | None) -> None:
        self.data_dir = data_dir
        """Where scans are recorded (None: kept in this object only)."""
        self._pool: ThreadPoolExecutor | None = None
        self._scans: dict[tuple[str, str], Future[corpus_scan.Scan]] = {}
        """Scans under way or done, by corpus prefix and fingerprint."""
        self._ready: set[int] = set()
        """Jobs whose corpora all passed (not looked at again)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        """Set by `close`: a scan under way ends at its next chunk."""

    def verdict(self, job: Job) -> str:
        """READY, SCANNING (a scan of one of its corpora is under way), or why the job cannot
        train (its first corpus out of the vocabulary, or that cannot be read)."""
        if job.id in self._ready:
            return READY
        why = self._verdict(job.spec)
        if why == READY:
            self._ready.add(job.id)
        return why

    @property
    def scanning(self) -> bool:
        """Whether a scan is under way."""
        with self._lock:
            return any(not f.done() for f in self._scans.values())

    def close(self) -> None:
        """Stop: a scan under way ends within a chunk (the controller's exit does not wait for
        it); nothing half done is recorded."""
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _verdict(self, spec: JobSpec) -> str:
        if not spec.data.corpora:
            return READY
        waiting = False
        for name in ("train", "valid"):
            for i, ref in enumerate(getattr(spec.data, name)):
                field = f"data.{name}.{i}.path"
                if changed(ref):  # not the files checked at submission: rank 0 fails the
                    continue  # job saying so (and where the path leads now), not retried
                try:
                    found = self._scan(ref.path, spec.planned_model.vocab)
                except (corpus.CorpusError, OSError) as exc:
                    return f"{field}: {exc}"
                if found is None:
                    waiting = True
                elif why := found.refusal(spec.planned_model.vocab):
                    return f"{field}: {corpus.bin_path(ref.path)}: {why}"
        return SCANNING if waiting else READY

    def _scan(self, prefix: str, vocab: int) -> corpus_scan.Scan | None:
        """The scan of corpus `prefix` (None: under way). CorpusError or OSError when it
        cannot be read."""
        found = corpus_scan.recorded(prefix, self.data_dir)
        if found is not None:
            return found
        key = (prefix, corpus_scan.scan_print(prefix))
        with self._lock:
            future = self._scans.get(key)
            if future is None:
                header = corpus.read_header(prefix)
                if not corpus_scan.needs_scan(header, vocab):
                    return corpus_scan.Scan(key[1], header.tokens, -1, -1, 0)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="corpus-scan")
                log.info("scanning %s for its largest token id (no record describes it)",
                         corpus.bin_path(prefix))
                self._scans[key] = future = self._pool.submit(self._run, prefix)
        if not future.done():
            return None
        with self._lock:
            if self.data_dir is not None or future.exception() is not None:
                del self._scans[key]  # recorded (looked up there next), or to try again
        return future.result()

    def _run(self, prefix: str) -> corpus_scan.Scan:
        return corpus_scan.scan_once(prefix, self.data_dir, self._stop)
