"""FastAPI dependencies and bounded path/query parameters, declared once as `Annotated` aliases.

FastAPI runs a sync dependency, a sync route and a sync route's answer validation each in its
thread pool: a hop there and back for each, about a tenth of a millisecond of CPU apiece. So
the dependencies that do no I/O are async, and the routes every page polls (a job's detail,
events and series, the jobs list, a submission, whoami) are async and do their reads and
writes in one hop (`run_in_threadpool`); the others stay sync, which is simpler.

Every integer a client puts in a path or a query is bounded by the range of the column it is
compared with (INTEGER: 32 bits on PostgreSQL; BIGINT for event ids), so that a too large
number is a 422 naming the parameter instead of a database overflow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import Depends, Header, HTTPException, Path, Query, Request

from service.contract import hf_config
from service.contract.specfiles import FileRefused
from service.files.checkpoint_dirs import CheckpointPlaces
from service.store import Job, NotFound, Store
from service.store.tables import IDEMPOTENCY_KEY_MAX

T = TypeVar("T")
INT32_MAX = 2**31 - 1
"""The largest value of an INTEGER column (job and probe ids, attempts, steps, ranks)."""
INT64_MAX = 2**63 - 1
"""The largest value of a BIGINT column (event ids)."""

JobId = Annotated[int, Path(ge=1, le=INT32_MAX, description="A job's id.")]
ProbeId = Annotated[int, Path(ge=1, le=INT32_MAX, description="A probe's id.")]
Offset = Annotated[int, Query(ge=0, le=INT32_MAX, description="Items to skip.")]
EventAfter = Annotated[int, Query(ge=0, le=INT64_MAX,
                                  description="Only events with an id above this one.")]
Rank = Annotated[int, Query(ge=0, le=INT32_MAX, description="The rank whose metrics to list.")]
Attempt = Annotated[int | None, Query(ge=1, le=INT32_MAX,
                                      description="Only this attempt (default: every one).")]
AfterStep = Annotated[int, Query(ge=0, le=INT32_MAX, description="Only steps above this one.")]
IdempotencyKey = Annotated[str | None, Header(
    min_length=1, max_length=IDEMPOTENCY_KEY_MAX, pattern=r"^[!-~]+$",
    description="Any string of printable ASCII characters without spaces (at most"
    f" {IDEMPOTENCY_KEY_MAX}), new for every job: a submission retried with the same key"
    " returns the job the first one created (200) instead of creating another; the same"
    " key with another spec is a 409. Keys are the caller's own: the same key from another"
    " user makes a job of the caller's.")]


async def read_hf_configs(request: Request) -> None:
    """Read the `model.hf_config` that the spec in this request's body names, before FastAPI
    validates the body (on the event loop, where no file is read): in a thread, within
    `TRIDENT_SPEC_FILE_READ_S`, a regular file of at most `TRIDENT_SPEC_FILE_MAX_BYTES`, where
    a job may read a checkpoint folder (`service.contract.hf_config.confined_reader`); a 422 naming
    the field when it cannot be. The config read is installed for the validation
    (`service.contract.hf_config.prepared`). Async, so that it is installed in the context FastAPI
    then validates the body in; a route lists it after its access check, so that no file is
    read for a caller who may not submit."""
    settings = request.app.state.settings
    path = hf_config.wanted(await _body_model(request))
    found: dict[str, dict[str, Any] | ValueError] = {}
    if path is not None:
        places = CheckpointPlaces(settings.checkpoint_root_dirs, settings.data_dir)
        reader = hf_config.confined_reader(places.read_refusal, settings.spec_file_max_bytes,
                                           "TRIDENT_SPEC_FILE_MAX_BYTES")
        try:
            found[path] = await off_loop(request, path, reader)
        except ValueError as exc:
            raise HTTPException(status_code=422, detail=[
                {"loc": ["body", "model", "hf_config"], "msg": str(exc),
                 "type": "value_error"}]) from None
    hf_config.install(hf_config.prepared(found))


async def _body_model(request: Request) -> Any:
    """The `model` of the request's JSON body (parsed already: FastAPI read it before the
    dependencies); None when there is none."""
    try:
        body = await request.json()
    except ValueError:
        return None
    return body.get("model") if isinstance(body, dict) else None


async def off_loop(request: Request, path: str, read: Callable[[str], T]) -> T:
    """`read(path)` in a thread of the app's own (`TRIDENT_SPEC_FILE_READERS` at once), the
    request awaiting it while others go on; FileRefused when it has not returned within
    `TRIDENT_SPEC_FILE_READ_S` (the thread is left to finish: a hung mount's `stat` cannot be
    interrupted)."""
    settings = request.app.state.settings
    state = request.app.state
    if getattr(state, "file_readers", None) is None:
        state.file_readers = anyio.CapacityLimiter(settings.spec_file_readers)
    try:
        with anyio.fail_after(settings.spec_file_read_s):
            return await anyio.to_thread.run_sync(read, path, limiter=state.file_readers,
                                                  abandon_on_cancel=True)
    except TimeoutError:
        raise FileRefused(f"{path}: not read within {settings.spec_file_read_s:g} s"
                          " (TRIDENT_SPEC_FILE_READ_S); is its file system answering?") from None


async def get_store(request: Request) -> Store:
    """The app's store. Async: a sync dependency runs in FastAPI's thread pool, a hop there
    and back on every request for an attribute read."""
    store: Store = request.app.state.store
    return store


StoreDep = Annotated[Store, Depends(get_store)]


def job_of(store: Store, job_id: int) -> Job:
    """Job `job_id`, or a 404 naming it."""
    try:
        return store.get_job(job_id=job_id)
    except NotFound as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None


def get_job(store: StoreDep, job_id: JobId) -> Job:
    return job_of(store, job_id)


JobDep = Annotated[Job, Depends(get_job)]
