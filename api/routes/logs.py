"""`GET /api/v1/jobs/{id}/logs`: every rank's stdout and stderr, read or followed live.

The files are written by the ranks (`workers.runtime.ranklog`) under `Settings.log_root`; this route
only reads them, by job id, attempt and rank (integers: the path cannot leave the log root).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import Field

from api.auth import require
from api.deps import INT32_MAX, JobDep, StoreDep
from api.schemas import LogPage, Refusal
from client.payloads import Chunk
from service.contract.states import JobState
from service.files.ranklogs import (
    attempt_log_dir,
    offset_at,
    read_chunk,
    tail_offset,
    with_times,
)
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

MAX_RANKS = 1024
"""The most ranks one request names."""
MAX_TAIL = 100_000
"""The most lines `tail` asks for per rank."""

LogRank = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None, Query(
    max_length=MAX_RANKS, description="Only these ranks (repeat; default: every rank).")]
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
Tail = Annotated[int | None, Query(ge=1, le=MAX_TAIL, description=(
    "Start each rank at its last this-many lines (looking back at most `max_bytes`)."))]
SinceTime = Annotated[datetime | None, Query(description=(
    "Start each rank at the output written at or after this time (ISO 8601, UTC unless it"
    " says otherwise, or unix seconds), to within the writer's half-second sampling."))]
Timestamps = Annotated[bool, Query(description=(
    "Give each chunk `times`: per line, the unix time by which it was written."))]


@dataclass(frozen=True)
class Reader:
    """How one request reads its ranks' logs: where each rank starts, and whether chunks
    carry line times."""

    directory: Path
    since: int
    since_time: datetime | None
    tail: int | None
    max_bytes: int
    timestamps: bool

    def start(self, rank: int) -> int:
        start = self.since
        if self.since_time is not None:
            when = self.since_time  # a time without a zone is UTC
            when = when if when.tzinfo else when.replace(tzinfo=UTC)
            start = max(start, offset_at(self.directory, rank, when.timestamp()))
        if self.tail is not None:
            start = max(start, tail_offset(self.directory, rank, self.tail, self.max_bytes))
        return start

    def read(self, rank: int, offset: int) -> Chunk:
        c = read_chunk(self.directory, rank, offset, self.max_bytes)
        return with_times(self.directory, c) if self.timestamps else c


def _ranks(job: Job, rank: list[int] | None) -> list[int]:
    if not rank:
        return list(range(job.world_size))
    if (bad := max(rank)) >= job.world_size:
        raise HTTPException(status_code=422, detail=[{
            "loc": ["query", "rank"], "type": "value_error",
            "msg": f"job {job.id} has ranks 0..{job.world_size - 1}, not {bad}"}])
    return sorted(set(rank))


def _attempt(job: Job, attempt: int | None) -> int | None:
    if attempt is not None and attempt > job.attempts:
        raise HTTPException(status_code=422, detail=[{
            "loc": ["query", "attempt"], "type": "value_error",
            "msg": f"job {job.id} has {job.attempts} attempt(s)"}])
    return attempt or (job.attempts or None)


@router.get("/{job_id}/logs", response_model=LogPage,
            responses={200: {"content": {"text/event-stream": {}}},
                       409: {"model": Refusal, "description": "The job has not started yet"}})
def logs(job: JobDep, store: StoreDep, request: Request, rank: LogRank = None,
         attempt: LogAttempt = None, since: Since = 0, follow: Follow = False,
         max_bytes: MaxBytes = 256 << 10, tail: Tail = None, since_time: SinceTime = None,
         timestamps: Timestamps = False) -> Any:
    """Rank logs of one attempt: per rank the text from `since` (or from its last `tail`
    lines, or from `since_time`: the latest of those), the `next` offset, the bytes the size
    cap dropped before it (`skipped`), the stream's size, and with `timestamps` each line's
    time. Each rank keeps at most `rank_log_max_bytes` (16 MiB by default) per attempt, the
    newest output."""
    settings = request.app.state.settings
    ranks = _ranks(job, rank)
    number = _attempt(job, attempt)
    cap = settings.rank_log_max_bytes
    if number is None:
        if follow:
            raise HTTPException(status_code=409, detail="the job has not started yet")
        return {"attempt": None, "max_bytes_per_rank": cap, "ranks": []}
    reader = Reader(attempt_log_dir(settings.log_root, job.id, number), since, since_time,
                    tail, max_bytes, timestamps)
    if not follow:
        chunks = [reader.read(r, reader.start(r)) for r in ranks]
        return {"attempt": number, "max_bytes_per_rank": cap,
                "ranks": [asdict(c) for c in chunks]}
    return StreamingResponse(_follow(store, job.id, reader, ranks, request),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _event(c: Chunk) -> str:
    return f"event: log\ndata: {json.dumps(asdict(c))}\n\n"


async def _follow(store: Any, job_id: int, reader: Reader, ranks: list[int],
                  request: Request) -> AsyncIterator[str]:
    offsets = {r: await run_in_threadpool(reader.start, r) for r in ranks}
    started = last_sent = time.monotonic()
    while time.monotonic() - started < FOLLOW_MAX_S:
        ended = (await run_in_threadpool(store.get_job, job_id=job_id)).state in TERMINAL
        sent = False
        for r in ranks:
            while True:
                c = await run_in_threadpool(reader.read, r, offsets[r])
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
