"""`GET /api/v1/jobs/{id}/logs`: every rank's stdout and stderr, read or followed live.

The files are written by the ranks (`workers.ranklog`) under `Settings.log_root`; this route
only reads them, by job id, attempt and rank (integers: the path cannot leave the log root).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api.auth import require
from api.deps import INT32_MAX, JobDep, StoreDep
from service.ranklogs import Chunk, attempt_log_dir, read_chunk
from service.states import JobState
from service.store import Job

router = APIRouter(prefix="/jobs", tags=["jobs"], dependencies=[Depends(require("jobs:read"))])

MAX_CHUNK = 1 << 20
"""The most bytes one answer carries per rank (1 MiB)."""
FOLLOW_POLL_S = 0.5
"""How often a follow stream looks for new output."""
FOLLOW_MAX_S = 3600
"""How long one follow stream lasts at most; clients reconnect with `since`."""
KEEPALIVE_S = 15
TERMINAL = {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}

LogRank = Annotated[int | None, Query(ge=0, le=INT32_MAX,
                                      description="Only this rank (default: every rank).")]
LogAttempt = Annotated[int | None, Query(ge=1, le=INT32_MAX,
                                         description="The attempt (default: the newest).")]
Since = Annotated[int, Query(ge=0, le=2**63 - 1, description=(
    "Stream offset to read from: the `next` of the previous answer (with `rank`; without it"
    " every rank starts here)."))]
Follow = Annotated[bool, Query(description=(
    "Stream as server-sent events (`event: log`, data: a rank's chunk as JSON) until the job"
    f" has ended and every byte was sent, or {FOLLOW_MAX_S} s."))]
MaxBytes = Annotated[int, Query(ge=1, le=MAX_CHUNK,
                                description="The most bytes per rank in one answer.")]


def _ranks(job: Job, rank: int | None) -> list[int]:
    if rank is None:
        return list(range(job.world_size))
    if rank >= job.world_size:
        raise HTTPException(status_code=422, detail=[{
            "loc": ["query", "rank"], "type": "value_error",
            "msg": f"job {job.id} has ranks 0..{job.world_size - 1}"}])
    return [rank]


def _attempt(job: Job, attempt: int | None) -> int | None:
    if attempt is not None and attempt > job.attempts:
        raise HTTPException(status_code=422, detail=[{
            "loc": ["query", "attempt"], "type": "value_error",
            "msg": f"job {job.id} has {job.attempts} attempt(s)"}])
    return attempt or (job.attempts or None)


@router.get("/{job_id}/logs", responses={200: {"content": {"text/event-stream": {}}}})
def logs(job: JobDep, store: StoreDep, request: Request, rank: LogRank = None,
         attempt: LogAttempt = None, since: Since = 0, follow: Follow = False,
         max_bytes: MaxBytes = 256 << 10) -> Any:
    """Rank logs of one attempt: per rank the text from `since`, the `next` offset, the bytes
    the size cap dropped before it (`skipped`) and the stream's size. Each rank keeps at most
    `rank_log_max_bytes` (16 MiB by default) per attempt, the newest output."""
    settings = request.app.state.settings
    ranks = _ranks(job, rank)
    number = _attempt(job, attempt)
    cap = settings.rank_log_max_bytes
    if number is None:
        if follow:
            raise HTTPException(status_code=409, detail="the job has not started yet")
        return {"attempt": None, "max_bytes_per_rank": cap, "ranks": []}
    directory = attempt_log_dir(settings.log_root, job.id, number)
    if not follow:
        chunks = [read_chunk(directory, r, since, max_bytes) for r in ranks]
        return {"attempt": number, "max_bytes_per_rank": cap,
                "ranks": [asdict(c) for c in chunks]}
    return StreamingResponse(_follow(store, job.id, directory, ranks, since, max_bytes,
                                     request),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _event(c: Chunk) -> str:
    return f"event: log\ndata: {json.dumps(asdict(c))}\n\n"


async def _follow(store: Any, job_id: int, directory: Any, ranks: list[int], since: int,
                  max_bytes: int, request: Request) -> AsyncIterator[str]:
    offsets = dict.fromkeys(ranks, since)
    started = last_sent = time.monotonic()
    while time.monotonic() - started < FOLLOW_MAX_S:
        ended = (await run_in_threadpool(store.get_job, job_id=job_id)).state in TERMINAL
        sent = False
        for r in ranks:
            while True:
                c = await run_in_threadpool(read_chunk, directory, r, offsets[r], max_bytes)
                if c.next == offsets[r] and not c.skipped:
                    break
                offsets[r] = c.next
                sent = True
                yield _event(c)
        if ended and not sent:
            yield "event: end\ndata: {}\n\n"
            return
        if await request.is_disconnected():
            return
        if not sent and time.monotonic() - last_sent > KEEPALIVE_S:
            yield ": keep-alive\n\n"
            sent = True
        if sent:
            last_sent = time.monotonic()
        await asyncio.sleep(FOLLOW_POLL_S)
