"""`trident profile`: torch.profiler around a rank's next N steps, on request.

The rank actor (`workers.rank.actor.RankActor.profile`) arms a `StepProfiler` from its own
thread; the training thread starts it where a step starts (the trainer's `step_started`
callback, at or after the step the controller named, so that every named rank profiles the
same steps) and stops it once N steps have reported. Each profiled step is a
`ProfilerStep#<step>` range (the job's own step number), the name TensorBoard's profile plugin
and torch's own `profiler.step()` use. The profiler only observes: the step's arithmetic, and
so its loss, is the same as without it (its time is not: recording shapes and stacks costs).

What comes back (`result`) is the files, gzipped, as bytes: the controller stores them with the
job (`service.control.profile_collect`). Each is bounded by `max_bytes` (compressed); one over
it is left out and named, and a trace over it fails the request with the size.
"""

from __future__ import annotations

import contextlib
import gzip
import pickle
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE = "rank-{rank}.pt.trace.json.gz"
"""The Chrome trace's file name: `*.pt.trace.json.gz` is what TensorBoard's profile plugin
(torch-tb-profiler) looks for, and Perfetto opens it as is."""
MEMORY_TIMELINE = "rank-{rank}.memory-timeline.json.gz"
"""`--memory`: the profiler's memory timeline (`export_memory_timeline`: times and bytes per
category)."""
CUDA_SNAPSHOT = "rank-{rank}.cuda-memory-snapshot.pickle.gz"
"""`--memory` on CUDA: `torch.cuda.memory._snapshot()` (gunzip it, then pytorch.org/memory_viz)."""


class Busy(Exception):
    """The rank is profiling for another request already."""


@dataclass
class _Request:
    id: int
    steps: int
    memory: bool
    start: int
    max_bytes: int
    first: int | None = None
    done: int = 0
    result: dict[str, Any] | None = None
    left_out: list[dict[str, Any]] = field(default_factory=list)


class StepProfiler:
    """One rank's profiler, armed for one request at a time (`arm`), run by the training
    thread (`step_started`, `step_ended`, `close`), read by the actor (`result`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._req: _Request | None = None
        self._answers: dict[int, dict[str, Any]] = {}
        self._prof: Any = None
        self._range: Any = None

    def arm(self, request_id: int, *, steps: int, memory: bool, start: int,
            max_bytes: int) -> None:
        """Profile `steps` steps from step `start` (or the first step to start after it);
        Busy while another request is armed or running."""
        with self._lock:
            if self._req is not None and self._req.result is None:
                raise Busy(f"rank {self.rank} is profiling for request {self._req.id}")
            self._req = _Request(request_id, steps, memory, start, max_bytes)

    def result(self, request_id: int) -> dict[str, Any] | None:
        """The request's answer once its steps are done (taken: asked once), else None:
        `{"rank", "steps": [first, last], "files": {name: gzipped bytes}, "left_out",
        "error"}`."""
        with self._lock:
            return self._answers.pop(request_id, None)

    # --- on the training thread ---------------------------------------------------------------

    def step_started(self, step: int) -> None:
        req = self._req
        if req is None or req.result is not None or step < req.start:
            return
        if self._prof is None:
            try:
                self._begin(req)
            except Exception as exc:  # the answer says why; training goes on unprofiled
                self._finish(req, error=f"the profiler did not start: {type(exc).__name__}:"
                             f" {exc}")
                return
            req.first = step
        import torch

        self._range = torch.autograd.profiler.record_function(f"ProfilerStep#{step}")
        self._range.__enter__()

    def step_ended(self, step: int) -> None:
        req = self._req
        if self._range is None or req is None:
            return
        self._range.__exit__(None, None, None)
        self._range = None
        req.done += 1
        if req.done >= req.steps:
            self._end(req, last=step)

    def close(self, why: str) -> None:
        """Training ended: a profile running is ended with the steps it has, one armed but
        not started is answered with `why`."""
        req = self._req
        if req is None or req.result is not None:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None and req.done and req.first is not None:
            self._end(req, last=req.first + req.done - 1)
        else:
            self._stop_quietly()
            self._finish(req, error=f"rank {self.rank}: {why} before a profiled step ended")

    # --- the profiler ---------------------------------------------------------------------------

    def _begin(self, req: _Request) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if req.memory and cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof = profile(activities=activities, record_shapes=True, with_stack=True,
                             profile_memory=req.memory)
        self._prof.start()

    def _stop_quietly(self) -> None:
        if self._prof is not None:
            # A profiler that did not start cleanly: nothing to keep.
            with contextlib.suppress(Exception):
                self._prof.stop()
            self._prof = None

    def _end(self, req: _Request, *, last: int) -> None:
        import torch

        prof, self._prof = self._prof, None
        files: dict[str, bytes] = {}
        cuda_memory = req.memory and torch.cuda.is_available()
        try:
            prof.stop()
            if cuda_memory:
                files[CUDA_SNAPSHOT.format(rank=self.rank)] = gzip.compress(
                    pickle.dumps(torch.cuda.memory._snapshot()), 6)
            with tempfile.TemporaryDirectory(prefix="trident-profile-") as tmp:
                trace = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(trace))
                files[TRACE.format(rank=self.rank)] = gzip.compress(trace.read_bytes(), 6)
                if req.memory:
                    timeline = Path(tmp) / "timeline.json.gz"
                    # Deprecated for CUDA's memory snapshot, which a CPU rank has not: kept
                    # for both, beside the snapshot on CUDA.
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", FutureWarning)
                        prof.export_memory_timeline(
                            str(timeline), f"cuda:{torch.cuda.current_device()}"
                            if torch.cuda.is_available() else "cpu")
                    files[MEMORY_TIMELINE.format(rank=self.rank)] = timeline.read_bytes()
        except Exception as exc:  # the answer says why; training goes on
            self._finish(req, error=f"rank {self.rank}: exporting the trace failed:"
                         f" {type(exc).__name__}: {exc}")
            return
        finally:
            if cuda_memory:  # the allocator records no more
                torch.cuda.memory._record_memory_history(enabled=None)
        assert req.first is not None
        kept = {}
        for name, data in files.items():
            if len(data) <= req.max_bytes:
                kept[name] = data
            else:
                req.left_out.append({"name": name, "bytes": len(data)})
        trace_name = TRACE.format(rank=self.rank)
        error = None if trace_name in kept else (
            f"rank {self.rank}: the trace of steps {req.first}-{last} is"
            f" {len(files[trace_name])} bytes gzipped, over the per-trace limit of"
            f" {req.max_bytes}: profile fewer steps")
        self._finish(req, error=error, files=kept, steps=[req.first, last])

    def _finish(self, req: _Request, *, error: str | None = None,
                files: dict[str, bytes] | None = None, steps: list[int] | None = None) -> None:
        answer = {"rank": self.rank, "steps": steps, "files": files or {},
                  "left_out": req.left_out, "error": error}
        with self._lock:
            req.result = answer
            self._answers[req.id] = answer
