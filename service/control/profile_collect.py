"""The controller's side of `trident profile`: have a running job's ranks profile, store the traces.

Each pass, `ProfileCollector.step` looks at the requests not answered yet
(`service.store.profile_requests`): one for a job this controller runs is taken and its group
asked to profile (`WorkerGroup.profile`) on a thread of its own, since the ranks answer only
once their profiled steps ended; the next pass after the answer came stores the trace files
with the job (`service.files.profiles`), within the per-file and per-job bounds of
`client.payloads` (the job's oldest requests' files dropped first). A request for a job with no
live group here fails with the reason, and so does one a previous controller took but never
answered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.cluster.data_plane import WorkerGroup
from service.control.asking import Asking, ask_beside, unanswerable
from service.files.profiles import NAME, ProfileFiles
from service.store.profile_requests import (
    PROFILE_MAX_JOB_BYTES,
    PROFILE_MAX_TRACE_BYTES,
    ProfileRequest,
    ProfileRequests,
    StackStatus,
)


class ProfileCollector:
    """Answers the stored profile requests of the jobs whose groups this controller runs."""

    def __init__(self, requests: ProfileRequests, files: ProfileFiles | None, *,
                 timeout_s: float = 900.0, max_trace_bytes: int = PROFILE_MAX_TRACE_BYTES,
                 max_job_bytes: int = PROFILE_MAX_JOB_BYTES) -> None:
        self.requests = requests
        self.files = files
        """None: this controller has no data directory to store traces in (they fail)."""
        self.timeout_s = timeout_s
        """How long ranks may take to profile their steps and send the traces."""
        self.max_trace_bytes = max_trace_bytes
        self.max_job_bytes = max_job_bytes
        self._inflight: dict[int, tuple[ProfileRequest, Asking]] = {}

    def step(self, groups: Mapping[int, tuple[WorkerGroup, int]]) -> None:
        """Store the traces that came in; take the new requests. `groups`: job id -> its live
        group and attempt."""
        for request_id, (req, p) in list(self._inflight.items()):
            if p.done.is_set():
                del self._inflight[request_id]
                if p.error is not None:
                    self.requests.finish(request_id=request_id, error=p.error)
                else:
                    self._store(req, p.answers)
        profiling = {req.job_id for req, _ in self._inflight.values()}
        for req in self.requests.open():
            if req.id in self._inflight or (req.job_id in profiling
                                            and req.status == StackStatus.PENDING):
                continue  # a job's ranks profile for one request at a time: it waits its turn
            why = unanswerable(req, groups, "their traces")
            if self.files is None and req.status != StackStatus.RUNNING:
                why = "this controller has no data directory to store traces in"
            if why is not None:
                self.requests.finish(request_id=req.id, error=why)
                continue
            group, attempt = groups[req.job_id]
            self.requests.take(request_id=req.id, attempt=attempt)
            self._inflight[req.id] = (req, self._ask(group, req))
            profiling.add(req.job_id)

    def _ask(self, group: WorkerGroup, req: ProfileRequest) -> Asking:
        return ask_beside(lambda: group.profile(
            req.id, ranks=req.ranks, steps=req.steps, memory=req.memory,
            max_bytes=self.max_trace_bytes, timeout_s=self.timeout_s), "profile")

    def _store(self, req: ProfileRequest, answers: Mapping[int, Any]) -> None:
        """Write the answers' files (rank order) within the bounds; finish the request."""
        assert self.files is not None
        missing: list[dict[str, Any]] = []
        left_out: list[dict[str, Any]] = []
        steps: dict[str, list[int]] = {}
        made: list[tuple[int, str, bytes]] = []
        for rank, answer in sorted(answers.items()):
            if not isinstance(answer, dict):
                missing.append({"rank": rank, "reason": str(answer)[:300]})
                continue
            for f in answer.get("left_out") or []:
                left_out.append({"rank": rank, "name": str(f.get("name"))[:80],
                                 "bytes": f.get("bytes"), "why": "over the per-trace limit"
                                 f" of {self.max_trace_bytes} bytes"})
            if answer.get("error"):
                missing.append({"rank": rank, "reason": str(answer["error"])[:300]})
            if answer.get("steps"):
                steps[str(rank)] = list(answer["steps"])
            for name, data in sorted((answer.get("files") or {}).items()):
                if NAME.fullmatch(name) and name.startswith(f"rank-{rank}.") and \
                        len(data) <= self.max_trace_bytes:
                    made.append((rank, name, data))
                else:
                    left_out.append({"rank": rank, "name": str(name)[:80], "bytes": len(data),
                                     "why": "not a trace file's name, or over the per-trace"
                                     " limit"})
        self._make_room(req, sum(len(d) for _, _, d in made))
        kept = self.requests.of_job(req.job_id)
        room = self.max_job_bytes - sum(f.bytes for r in kept if r.id != req.id
                                        for f in r.files)
        files = []
        for rank, name, data in made:
            if len(data) > room:
                left_out.append({"rank": rank, "name": name, "bytes": len(data),
                                 "why": f"over the per-job limit of {self.max_job_bytes}"
                                 " bytes"})
                continue
            try:
                self.files.write(req.job_id, req.id, name, data)
            except OSError as exc:
                left_out.append({"rank": rank, "name": name, "bytes": len(data),
                                 "why": f"writing it failed: {exc}"[:300]})
                continue
            room -= len(data)
            files.append({"rank": rank, "name": name, "bytes": len(data)})
        self.files.prune(req.job_id, {r.id for r in kept})
        error = None if files else "no trace stored: " + ("; ".join(
            f"rank {m['rank']}: {m['reason']}" for m in missing) or "every file was left out")
        self.requests.finish(request_id=req.id, error=error, result={
            "files": files, "steps": steps, "missing": missing, "left_out": left_out})

    def _make_room(self, req: ProfileRequest, needed: int) -> None:
        """Drop the job's oldest requests' files until `needed` more bytes fit."""
        assert self.files is not None
        older = [r for r in reversed(self.requests.of_job(req.job_id))
                 if r.id != req.id and r.files]
        total = sum(f.bytes for r in older for f in r.files)
        while older and total + needed > self.max_job_bytes:
            r = older.pop(0)
            self.files.remove(req.job_id, r.id)
            self.requests.drop(request_id=r.id, why=f"dropped for request {req.id}: the job"
                               f" keeps at most {self.max_job_bytes} bytes of traces")
            total -= sum(f.bytes for f in r.files)

    @property
    def pending(self) -> int:
        """Requests being profiled now."""
        return len(self._inflight)
