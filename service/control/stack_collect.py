"""The controller's side of `trident stacks`: collect a running job's stacks beside the loop.

Each pass, `StackCollector.step` looks at the requests not answered yet
(`service.store.stack_requests`): one for a job this controller runs is taken and its group asked
for every rank's thread stacks (`WorkerGroup.thread_stacks`) on a thread of its own, since
ranks may take up to `timeout_s` to answer and a pass must not wait; the next pass after the
answer came stores it, grouped by `group_stacks`. A request for a job with no live group here
fails with the reason, and so does one a previous controller took but never answered (it
stopped meanwhile).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.cluster.data_plane import WorkerGroup
from service.control.asking import Asking, ask_beside, unanswerable
from service.store.stack_requests import StackRequests

STACK_MAX_BYTES = 32 << 10
"""The most text kept of one thread's stack (its innermost frames)."""
THREADS_MAX = 64
"""Threads kept per rank."""
RESULT_MAX_BYTES = 4 << 20
"""The most stack text one answer stores; groups beyond it keep their ranks, not the text."""
TRAIN_THREAD = "train"
"""The name the rank actor gives its work thread (`RankActor.thread_stacks`): listed first."""


def group_stacks(answers: Mapping[int, Any], max_bytes: int = RESULT_MAX_BYTES
                 ) -> dict[str, Any]:
    """Per thread name, the ranks grouped by identical stack (largest group first), and the
    ranks that gave no stacks with the reason. `answers[rank]` is a list of `{"thread",
    "stack"}` or a string saying why there is none. JSON-ready:
    `{"ranks": n, "threads": [{"thread", "groups": [{"ranks", "stack"}]}],
    "missing": [{"reason", "ranks"}], "left_out": n}`; `stack` is None for the groups
    left out of an answer over `max_bytes` (`left_out` counts them)."""
    threads: dict[str, dict[str, list[int]]] = {}
    missing: dict[str, list[int]] = {}
    for rank, answer in sorted(answers.items()):
        if not isinstance(answer, list):
            missing.setdefault(str(answer)[:200], []).append(rank)
            continue
        for t in answer[:THREADS_MAX]:
            name, stack = str(t.get("thread"))[:128], str(t.get("stack"))[-STACK_MAX_BYTES:]
            ranks = threads.setdefault(name, {}).setdefault(stack, [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    budget, left_out = max_bytes, 0
    out = []
    for name in sorted(threads, key=lambda n: (n != TRAIN_THREAD, n)):
        groups = []
        for stack, ranks in sorted(threads[name].items(), key=lambda kv: (-len(kv[1]), kv[1])):
            keep = len(stack) <= budget
            budget -= len(stack) if keep else 0
            left_out += not keep
            groups.append({"ranks": ranks, "stack": stack if keep else None})
        out.append({"thread": name, "groups": groups})
    return {"ranks": len(answers), "threads": out, "left_out": left_out,
            "missing": [{"reason": reason, "ranks": ranks} for reason, ranks in missing.items()]}


class StackCollector:
    """Answers the stored stack requests of the jobs whose groups this controller runs."""

    def __init__(self, requests: StackRequests, *, timeout_s: float = 10.0,
                 max_bytes: int = STACK_MAX_BYTES) -> None:
        self.requests = requests
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._inflight: dict[int, Asking] = {}

    def step(self, groups: Mapping[int, tuple[WorkerGroup, int]]) -> None:
        """Store the answers that came in; take the new requests. `groups`: job id -> its
        live group and attempt."""
        for request_id, c in list(self._inflight.items()):
            if c.done.is_set():
                del self._inflight[request_id]
                if c.error is not None:
                    self.requests.finish(request_id=request_id, error=c.error)
                else:
                    self.requests.finish(request_id=request_id, result=group_stacks(c.answers))
        for req in self.requests.open():
            if req.id in self._inflight:
                continue
            why = unanswerable(req, groups, "the stacks")
            if why is not None:
                self.requests.finish(request_id=req.id, error=why)
                continue
            group, attempt = groups[req.job_id]
            self.requests.take(request_id=req.id, attempt=attempt)
            self._inflight[req.id] = self._ask(group)

    def _ask(self, group: WorkerGroup) -> Asking:
        return ask_beside(lambda: group.thread_stacks(self.timeout_s, self.max_bytes), "stacks")

    @property
    def pending(self) -> int:
        """Requests being collected now."""
        return len(self._inflight)
