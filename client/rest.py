"""`TridentClient`: Trident's REST API (`/api/v1`) from Python, the way `trident` uses it.

Every route has a method that returns the API's own models (`client.payloads`, the REST
contract, which holds the rows an answer carries too, such as `Event` and `Probe`), never a
dict to index. The token is found as the CLI finds it (`client.token.token_for`:
`TRIDENT_TOKEN`, the `trident login` profile, a local server's bootstrap token file) unless
one is given. Refusals are exceptions that name the
status and, for a 422, the field (`ApiError.field`); a server that does not answer is a
`ConnectionFailed` naming the URL. Idempotent requests (GET, and a submission, which carries
an `Idempotency-Key` the client makes) are retried after a transport error or a
502/503/504, with backoff; nothing else is. docs/client.md is its guide.

The `trident` commands (cli/) are its callers; tests/test_client.py runs it against
a live server. One module: the client is one class, with its errors and the log stream it
follows; its methods are one per route, in the order of the API's route modules.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar, cast
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from client.ledger import GoodputSummary, Ledger
from client.payloads import (
    AttemptList,
    AuditList,
    CalibratedProfileOut,
    CheckpointList,
    Chunk,
    ClusterView,
    CommSteps,
    CommView,
    Comparison,
    Event,
    EventList,
    ExportFiles,
    ExportList,
    ExportRecord,
    HangList,
    Health,
    JobList,
    JobOut,
    JobTracking,
    LayoutSearch,
    LogPage,
    MetricList,
    NewToken,
    Node,
    PlanOut,
    Probe,
    ProbeList,
    ProfileList,
    ProfileRequest,
    Project,
    ProjectList,
    RanksGrid,
    Series,
    StackRequest,
    Token,
    TokenList,
    TrackingInfo,
    User,
    UserList,
    WhoAmI,
)
from client.token import token_for
from service.contract.spec import JobSpec

DEFAULT_SERVER = "http://127.0.0.1:8000"
"""The server when neither the caller nor `TRIDENT_SERVER` names one (`trident up`'s)."""
API_PREFIX = "/api/v1"
RETRY_STATUS = frozenset({502, 503, 504})
"""The server could not answer now (a proxy, a restart, the database away): worth a retry."""
BACKOFF_S = 0.5
"""The first retry's wait; each next one waits twice as long, up to `BACKOFF_MAX_S`."""
BACKOFF_MAX_S = 5.0
RECONNECTS = 5
"""How many times in a row `follow_logs` reconnects after the stream broke."""
RECONNECT_BACKOFF_S = 1.0
"""The first reconnect waits twice this, each next one twice as long, up to 10 s."""
PAGE = 1000
"""Events per request when paging (the API's most)."""
JOB_PAGE = 500
"""Jobs per request when paging (the API's most)."""

T = TypeVar("T")


# --- errors --------------------------------------------------------------------------------------

class TridentError(Exception):
    """Anything the client could not do: the base of every error it raises."""


class BadServerURL(TridentError, ValueError):
    """The server's URL cannot be an API's base URL (it names a path of the API itself)."""


class ConnectionFailed(TridentError):
    """The server did not answer (refused, timed out, reset), after the retries allowed."""

    def __init__(self, url: str, reason: str) -> None:
        self.url, self.reason = url, reason
        super().__init__(f"cannot reach the Trident API at {url}: {reason}")


class NotTridentAPI(TridentError):
    """Something answered at the URL, but not as the Trident API does: no such route, or a
    body that is not the API's JSON."""

    def __init__(self, url: str, why: str) -> None:
        self.url = url
        super().__init__(f"{url}: {why}")


@dataclasses.dataclass(frozen=True)
class FieldError:
    """One refused field of a 422: where (`body`, `query`, `header`, `path`), which field
    (dotted, `parallel.tp`), and why."""

    location: str
    field: str
    message: str

    @classmethod
    def of(cls, item: dict[str, Any]) -> FieldError:
        """One item of a 422's `detail`: `{"loc": ["body", "parallel", "tp"], "msg": ...}`."""
        loc = [str(p) for p in item.get("loc") or []]
        return cls(loc[0] if loc else "", ".".join(loc[1:]) or "request", str(item.get("msg")))


class ApiError(TridentError):
    """The API refused the request: its status, its reason (`detail`) and, for a 422, the
    fields it refused (the first is `field`). `str()` is `STATUS: reason`, a 422's as
    `field: reason; ...`."""

    def __init__(self, status: int, detail: str, *, method: str, url: str,
                 errors: tuple[FieldError, ...] = (), server: str = "",
                 token_source: str = "") -> None:
        self.status, self.detail, self.method, self.url = status, detail, method, url
        self.errors = errors
        self.server, self.token_source = server, token_source
        """The server asked, and where the client's token came from (`TridentClient`)."""
        super().__init__(f"{status}: {detail}")

    @property
    def field(self) -> str | None:
        """The first field refused (a 422), e.g. `parallel.tp`; None otherwise."""
        return self.errors[0].field if self.errors else None


class Unauthorized(ApiError):
    """401: the token is missing, unknown, expired or revoked, or its user is disabled."""


class Forbidden(ApiError):
    """403: the caller's role, or its ownership of the object, does not allow this."""


class NotFound(ApiError):
    """404: what the path names (a job, a token, a user, ...) does not exist."""


class Conflict(ApiError):
    """409: the object's state refuses it (an ended job, a taken name, a reused key)."""


class Invalid(ApiError):
    """422: a field is refused; `errors` has each, `field` the first."""


class TooManyRequests(ApiError):
    """429: too many requests of this kind are waiting (stack requests of a job)."""


class ExportFailed(TridentError):
    """An export's task failed (`TridentClient.wait_export`): the reason it recorded."""


class Unavailable(ApiError):
    """5xx: the server could not answer now (the database away, a proxy); retried first."""


_BY_STATUS: dict[int, type[ApiError]] = {401: Unauthorized, 403: Forbidden, 404: NotFound,
                                         409: Conflict, 422: Invalid, 429: TooManyRequests}


def _refusal(r: httpx.Response, client: TridentClient) -> ApiError | NotTridentAPI:
    """The exception for a 4xx/5xx answer."""
    method, url = r.request.method, str(r.request.url)
    try:
        detail: Any = r.json().get("detail")
    except (ValueError, AttributeError):
        detail = r.text.strip()[:300] or r.reason_phrase
    if r.status_code == 404 and detail == "Not Found":
        # Starlette's own answer for a path no route has: the URL is wrong, not the object.
        return NotTridentAPI(url, f"404: no such route of the Trident API ({method}); is"
                             " the server URL the base URL of a Trident server?")
    errors: tuple[FieldError, ...] = ()
    if isinstance(detail, list):  # a 422's: per field, where, which, and the arithmetic
        errors = tuple(FieldError.of(d) for d in detail if isinstance(d, dict))
        detail = "; ".join(f"{e.field}: {e.message}" for e in errors)
    kind = _BY_STATUS.get(r.status_code, Unavailable if r.status_code >= 500 else ApiError)
    return kind(r.status_code, str(detail), method=method, url=url, errors=errors,
                server=client.server, token_source=client.token_source)


# --- parsing -------------------------------------------------------------------------------------

_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def _adapter(tp: Any) -> TypeAdapter[Any]:
    """`tp`'s TypeAdapter, made once (making one compiles a validator)."""
    if (found := _ADAPTERS.get(tp)) is None:
        found = _ADAPTERS[tp] = TypeAdapter(tp)
    return found


def _parse(tp: type[T] | Any, r: httpx.Response) -> T:
    """The answer as `tp`; a body that is not its JSON is a `NotTridentAPI`."""
    url = str(r.request.url)
    try:
        data = r.json()
    except ValueError:
        raise NotTridentAPI(url, f"answered {r.request.method} with something that is not"
                            " JSON (is it a Trident API?)") from None
    try:
        return cast(T, _adapter(tp).validate_python(data))
    except ValidationError as exc:
        raise NotTridentAPI(url, f"the answer is not a {getattr(tp, '__name__', tp)}"
                            f" ({exc.error_count()} field(s) differ: a client and a server"
                            " of different versions?)") from None


def unseen(chunk: Chunk, printed: dict[int, int]) -> Chunk:
    """`chunk` without the bytes of its rank already yielded (a reconnected stream starts at
    the lowest offset of all its ranks); records what it leaves to yield."""
    raw = chunk.text.encode("utf-8", errors="replace")
    start = chunk.next - len(raw)
    seen = printed.get(chunk.rank, start)
    printed[chunk.rank] = max(seen, chunk.next)
    if seen <= start:
        return chunk
    cut = raw[:seen - start]
    times = chunk.times
    return dataclasses.replace(
        chunk, text=raw[seen - start:].decode("utf-8", errors="replace"), skipped=0,
        times=times[cut.count(b"\n"):] if times else times)


def _query(**params: Any) -> dict[str, Any]:
    """Query parameters without the unset ones (None, an empty list)."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        if v is None or (isinstance(v, list | tuple) and not v):
            continue
        out[k] = v.isoformat() if isinstance(v, datetime) else v
    return out


def _base_url(server: str) -> str:
    """`server` without a trailing `/`; refused when it names a path of the API itself."""
    parts = urlsplit(server.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BadServerURL(f"{server!r} is not an http(s) URL (e.g. {DEFAULT_SERVER})")
    path = parts.path.rstrip("/")
    if path.endswith(API_PREFIX):
        base = urlunsplit((parts.scheme, parts.netloc, path[:-len(API_PREFIX)], "", ""))
        raise BadServerURL(f"{server} ends in {API_PREFIX}: give the server's base URL,"
                           f" {base}")
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


# --- the client ----------------------------------------------------------------------------------

class TridentClient:
    """A Trident server's REST API. Use it as a context manager (or call `close`).

    `server`: the base URL (default `TRIDENT_SERVER`, else http://127.0.0.1:8000); `token`:
    the API token (default: found as the CLI finds it, `token_source` says where);
    `retries`: how many more times an idempotent request is sent after a transport error or
    a 502/503/504; `transport`: an httpx transport to send through (tests, proxies).
    """

    def __init__(self, server: str | None = None, *, token: str | None = None,
                 timeout: float = 30, retries: int = 3,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.server = _base_url(server or os.environ.get("TRIDENT_SERVER") or DEFAULT_SERVER)
        if token is None:
            token, self.token_source = token_for(self.server)
        else:
            self.token_source = "the caller"
        self.retries = retries
        self._http = httpx.Client(
            base_url=self.server + API_PREFIX, timeout=timeout, transport=transport,
            headers={"Authorization": f"Bearer {token}"} if token else {})

    def __enter__(self) -> TridentClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def __repr__(self) -> str:
        return f"TridentClient({self.server!r})"

    # -- sending ---------------------------------------------------------------------------------

    def _send(self, method: str, path: str, *, retry: bool = False,
              **kw: Any) -> httpx.Response:
        """One request (`retries` more when `retry`, for a request safe to repeat); the
        answer, or the exception for its refusal."""
        tries = self.retries + 1 if retry else 1
        for attempt in range(tries):
            last = attempt == tries - 1
            try:
                r = self._http.request(method, path, **kw)
            except httpx.HTTPError as exc:
                if last:
                    raise ConnectionFailed(self.server, str(exc) or type(exc).__name__
                                           ) from None
            else:
                if r.status_code not in RETRY_STATUS or last:
                    break
            time.sleep(min(BACKOFF_S * 2**attempt, BACKOFF_MAX_S))
        if r.status_code >= 400:
            raise _refusal(r, self)
        return r

    def _get(self, tp: type[T] | Any, path: str, **params: Any) -> T:
        return _parse(tp, self._send("GET", path, retry=True, params=_query(**params)))

    def _post(self, tp: type[T] | Any, path: str, body: Any = None, **kw: Any) -> T:
        return _parse(tp, self._send("POST", path, json=body, **kw))

    # -- jobs ------------------------------------------------------------------------------------

    def submit(self, spec: JobSpec | Mapping[str, Any], *, project: str | None = None,
               idempotency_key: str | None = None) -> JobOut:
        """Validate, plan and queue a job (`POST /jobs`), owned by the caller, under
        `project` (default: the caller's first). Retried under one `Idempotency-Key` (made
        here unless given), so that a retry never queues the job twice."""
        body = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else dict(spec)
        if isinstance(spec, JobSpec) and spec.secrets:  # write-only: no dump carries them
            body["secrets"] = spec.secret_values()
        key = idempotency_key or f"client-{uuid.uuid4().hex}"
        return _parse(JobOut, self._send("POST", "/jobs", retry=True, json=body,
                                         params=_query(project=project),
                                         headers={"Idempotency-Key": key}))

    def list_jobs(self, *, state: list[str] | None = None, owner: str | None = None,
                  project: str | None = None, name: str | None = None,
                  sort: str | None = None, desc: bool = True, limit: int = 50,
                  offset: int = 0) -> JobList:
        """One page of jobs (`GET /jobs`), newest first unless `sort`/`desc` say otherwise;
        `state` selects any of several states, `name` is a substring."""
        return self._get(JobList, "/jobs", state=state, owner=owner, project=project,
                         name=name, sort=sort, desc=desc, limit=limit,
                         offset=offset or None)

    def iter_jobs(self, **filters: Any) -> Iterator[JobOut]:
        """Every job the filters of `list_jobs` select, page after page."""
        offset = 0
        while True:
            page = self.list_jobs(**filters, limit=JOB_PAGE, offset=offset)
            yield from page.items
            offset += len(page.items)
            if not page.items or offset >= page.total:
                return

    def get_job(self, job_id: int) -> JobOut:
        """A job with its plan, its plan against the measurement and its line of the list."""
        return self._get(JobOut, f"/jobs/{job_id}")

    def cancel_job(self, job_id: int) -> JobOut:
        """Ask for a job's cancellation; a job that has ended is a `Conflict` (409)."""
        return self._post(JobOut, f"/jobs/{job_id}/cancel")

    def resubmit_job(self, job_id: int, *, from_checkpoint: int | None = None,
                     changes: Mapping[str, Any] | None = None) -> JobOut:
        """Queue a new job with a job's stored spec, `changes` (dotted field -> value)
        applied; with `from_checkpoint` (0: the newest tag, N: the tag of step N) it starts
        from that job's checkpoint, on whatever layout `changes` gives it. The new job."""
        body: dict[str, Any] | None = None
        if from_checkpoint is not None or changes:
            body = {"from_checkpoint": from_checkpoint, "set": dict(changes or {})}
        return self._post(JobOut, f"/jobs/{job_id}/resubmit", body)

    def list_events(self, job_id: int, *, after: int = 0, limit: int = 200) -> EventList:
        """A job's events after event id `after`, oldest first."""
        return self._get(EventList, f"/jobs/{job_id}/events", after=after or None,
                         limit=limit)

    def iter_events(self, job_id: int, *, after: int = 0) -> Iterator[Event]:
        """Every event of a job after event id `after`, oldest first, page after page."""
        while True:
            items = self.list_events(job_id, after=after, limit=PAGE).items
            yield from items
            if len(items) < PAGE:
                return
            after = items[-1].id

    def list_metrics(self, job_id: int, *, rank: int = 0, attempt: int | None = None,
                     after_step: int = 0, limit: int = 10000) -> MetricList:
        """One rank's step reports after `after_step` (every attempt, or `attempt`)."""
        return self._get(MetricList, f"/jobs/{job_id}/metrics", rank=rank or None,
                         attempt=attempt, after_step=after_step or None, limit=limit)

    def list_attempts(self, job_id: int) -> AttemptList:
        """Every attempt of a job: status, placement (the node of every rank), error."""
        return self._get(AttemptList, f"/jobs/{job_id}/attempts")

    def list_checkpoints(self, job_id: int, *, removed: bool = False) -> CheckpointList:
        """A job's checkpoint tags (step, size, layout, time) and its bytes on disk; with
        `removed`, the tags its retention policy deleted too."""
        return self._get(CheckpointList, f"/jobs/{job_id}/checkpoints",
                         removed="true" if removed else None)

    def start_export(self, job_id: int, *, step: int | None = None,
                     max_shard_size: str | None = None,
                     destination: str | None = None) -> ExportRecord:
        """Export a job's checkpoint tag (`step`, default the newest complete one) as a Hugging
        Face folder, written by a task on the cluster under an export root (`destination`,
        default the server's `<root>/<owner>/job-<id>-step<N>`), in safetensors files of at
        most `max_shard_size` (e.g. `500MB`; default 5GB): `POST /jobs/{id}/exports`."""
        body = {k: v for k, v in (("step", step), ("max_shard_size", max_shard_size),
                                  ("destination", destination)) if v is not None}
        return self._post(ExportRecord, f"/jobs/{job_id}/exports", body)

    def get_export(self, job_id: int, export_id: int) -> ExportRecord:
        return self._get(ExportRecord, f"/jobs/{job_id}/exports/{export_id}")

    def list_exports(self, job_id: int) -> ExportList:
        """A job's exports, newest first: where each went, its state, files, bytes."""
        return self._get(ExportList, f"/jobs/{job_id}/exports")

    def export_files(self, job_id: int, export_id: int) -> ExportFiles:
        return self._get(ExportFiles, f"/jobs/{job_id}/exports/{export_id}/files")

    def wait_export(self, job_id: int, export_id: int, *, poll_s: float = 0.5,
                    timeout_s: float | None = None) -> ExportRecord:
        """The export once done; ExportFailed with its reason when it failed; TimeoutError
        after `timeout_s` (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (rec := self.get_export(job_id, export_id)).state in ("pending", "running"):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"export {export_id} of job {job_id} is {rec.state}")
            time.sleep(poll_s)
        if rec.state != "done":
            raise ExportFailed(f"export {export_id} of job {job_id} failed: {rec.error}")
        return rec

    def download_export(self, job_id: int, export_id: int,
                        out: str | os.PathLike[str]) -> str:
        """A finished export's folder written as `out` (which must not exist), file by file
        (`client.exports`: one streaming GET a file, written as it arrives, sizes checked,
        renamed into place once whole). The folder's path. `OSError` when `out` cannot be
        written; `ConnectionFailed` when an answer breaks off."""
        from client import exports

        listed = self.export_files(job_id, export_id)
        target, work = exports.prepare(out)
        try:
            for f in listed.items:
                exports.fetch(self._http, f"/jobs/{job_id}/exports/{export_id}/files/"
                              f"{quote(f.name)}", os.path.join(work, f.name), f.bytes,
                              lambda r: _refusal(r, self))
        except httpx.HTTPError as exc:
            shutil.rmtree(work, ignore_errors=True)
            raise ConnectionFailed(self.server, f"the export of job {job_id} broke off:"
                                   f" {exc or type(exc).__name__}") from None
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return exports.finish(work, target)

    def export(self, job_id: int, out: str | os.PathLike[str], *, step: int | None = None,
               max_shard_size: str | None = None, destination: str | None = None,
               timeout_s: float | None = None) -> str:
        """`start_export`, `wait_export`, then `download_export` into `out`: the folder's
        path. `out` is checked first (`client.exports.check`: FileExistsError when it
        exists, NotADirectoryError when a file is on its way)."""
        from client import exports

        exports.check(out)
        rec = self.start_export(job_id, step=step, max_shard_size=max_shard_size,
                                destination=destination)
        self.wait_export(job_id, rec.id, timeout_s=timeout_s)
        return self.download_export(job_id, rec.id, out)

    def get_comm(self, job_id: int, *, last: int = 100) -> CommView:
        """Communication per TP/PP/DP over the newest attempt's last `last` steps."""
        return self._get(CommView, f"/jobs/{job_id}/comm", last=last)

    # -- the dashboard's job views ---------------------------------------------------------------

    def get_series(self, job_id: int, *, max_points: int | None = None) -> Series:
        """Rank 0's loss, step time, tokens/s and MFU per step, downsampled."""
        return self._get(Series, f"/jobs/{job_id}/series", max_points=max_points)

    def get_ranks(self, job_id: int) -> RanksGrid:
        """Every rank of the newest attempt: coordinates, node, memory, compute, marks."""
        return self._get(RanksGrid, f"/jobs/{job_id}/ranks")

    def get_comm_steps(self, job_id: int, *, last: int = 20) -> CommSteps:
        """Each recent step's split into compute, TP, PP, DP and bubble, and the plan's."""
        return self._get(CommSteps, f"/jobs/{job_id}/comm/steps", last=last)

    def list_hangs(self, job_id: int) -> HangList:
        """Every hang diagnosis of a job, newest first, with the ranks' stacks grouped."""
        return self._get(HangList, f"/jobs/{job_id}/hangs")

    # -- tracking and comparison ------------------------------------------------------------------

    def job_tracking(self, job_id: int) -> JobTracking:
        """Where a job's steps went: per tracker its run or directory, the steps sent and
        dropped, the newest failure."""
        return self._get(JobTracking, f"/jobs/{job_id}/tracking")

    def tracking_info(self) -> TrackingInfo:
        """The server's trackers: its MLflow servers, where TensorBoard files are written."""
        return self._get(TrackingInfo, "/tracking")

    def compare(self, job_ids: list[int]) -> Comparison:
        """Jobs side by side (2 to 8): figures, differing spec fields, curves."""
        return self._get(Comparison, "/compare", jobs=list(job_ids))

    # -- goodput ---------------------------------------------------------------------------------

    def job_goodput(self, job_id: int) -> Ledger:
        """Where a job's wall time went, by category (they add up to it), what its ranks
        held meanwhile, its ETTR, goodput in tokens and (where prices are set) its cost."""
        return self._get(Ledger, f"/jobs/{job_id}/goodput")

    def goodput(self, *, since: datetime | None = None, until: datetime | None = None,
                project: str | None = None, owner: str | None = None) -> GoodputSummary:
        """The ledgers of the jobs that lived in [since, until], summed per project, per
        owner and over the cluster, with the jobs that lost the most time."""
        return self._get(GoodputSummary, "/goodput", since=since, until=until,
                         project=project, owner=owner)

    # -- rank logs -------------------------------------------------------------------------------

    def get_logs(self, job_id: int, *, rank: list[int] | None = None,
                 attempt: int | None = None, since: int = 0, max_bytes: int | None = None,
                 tail: int | None = None, since_time: datetime | None = None,
                 timestamps: bool = False) -> LogPage:
        """One answer of rank output (at most `max_bytes` per rank) from offset `since`, or
        each rank's last `tail` lines, or what was written from `since_time` on."""
        return self._get(LogPage, f"/jobs/{job_id}/logs", rank=rank, attempt=attempt,
                         since=since or None, max_bytes=max_bytes, tail=tail,
                         since_time=since_time, timestamps=timestamps)

    def read_logs(self, job_id: int, **select: Any) -> Iterator[Chunk]:
        """All the output `get_logs(**select)` starts at, rank after rank, page by page."""
        for c in self.get_logs(job_id, **select).ranks:
            yield c
            more = {k: v for k, v in select.items()
                    if k not in ("tail", "since_time", "rank", "since")}
            while c.next < c.size:
                c = self.get_logs(job_id, **more, rank=[c.rank], since=c.next).ranks[0]
                yield c

    def follow_logs(self, job_id: int, *, rank: list[int] | None = None,
                    attempt: int | None = None, since: int = 0, tail: int | None = None,
                    since_time: datetime | None = None,
                    timestamps: bool = False) -> Iterator[Chunk]:
        """Rank output as it is written, until the job has ended and all of it was sent.
        The server ends a stream after an hour, and a restart ends it too: then this
        reconnects (from the lowest offset its ranks reached, yielding nothing twice)."""
        params = _query(rank=rank, attempt=attempt, since=since or None, tail=tail,
                        since_time=since_time, timestamps=timestamps or None)
        printed: dict[int, int] = {}
        query, failures = {**params, "follow": True}, 0
        while True:
            try:
                with self._http.stream("GET", f"/jobs/{job_id}/logs", params=query,
                                       timeout=httpx.Timeout(30, read=None)) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        raise _refusal(resp, self)
                    for line in resp.iter_lines():
                        if line.startswith("event: end"):
                            return
                        if line.startswith("data: "):
                            chunk = _adapter(Chunk).validate_python(json.loads(line[6:]))
                            yield unseen(chunk, printed)
                            failures = 0
            except httpx.TransportError as exc:
                failures += 1
                if failures > RECONNECTS:
                    raise ConnectionFailed(self.server, str(exc) or type(exc).__name__
                                           ) from None
                time.sleep(min(RECONNECT_BACKOFF_S * 2**failures, 10.0))
            time.sleep(0.2)
            # Again from where every rank got to (a rank not heard from: from the start; the
            # `since_time` still holds, `tail` was met).
            every = bool(rank) and set(rank or ()) <= set(printed)
            query = {**{k: v for k, v in params.items() if k != "tail"}, "follow": True,
                     "since": min(printed.values()) if every else since}

    # -- stacks ----------------------------------------------------------------------------------

    def request_stacks(self, job_id: int) -> StackRequest:
        """Ask every rank of a RUNNING job for its Python stacks; poll `get_stacks`."""
        return self._post(StackRequest, f"/jobs/{job_id}/stacks")

    def get_stacks(self, job_id: int, request_id: int) -> StackRequest:
        """A stack request and, once `done`, its answer (`api.schemas.StackAnswer.of`)."""
        return self._get(StackRequest, f"/jobs/{job_id}/stacks/{request_id}")

    # -- profiles --------------------------------------------------------------------------------

    def request_profile(self, job_id: int, *, steps: int = 3, ranks: list[int] | None = None,
                        memory: bool = False) -> ProfileRequest:
        """Have ranks of a RUNNING job (default all) run torch.profiler over their next
        `steps` steps; poll `get_profile`, then `download_profile`."""
        return self._post(ProfileRequest, f"/jobs/{job_id}/profile",
                          {"steps": steps, "ranks": ranks, "memory": memory})

    def get_profile(self, job_id: int, request_id: int) -> ProfileRequest:
        """A profile request and, once `done`, its files."""
        return self._get(ProfileRequest, f"/jobs/{job_id}/profile/{request_id}")

    def list_profiles(self, job_id: int) -> ProfileList:
        """The job's profile requests, newest first, with their files and the bounds."""
        return self._get(ProfileList, f"/jobs/{job_id}/profile")

    def download_profile(self, job_id: int, request_id: int,
                         out: str | os.PathLike[str]) -> list[str]:
        """Every file of a done request into folder `out` (made if missing), streamed one
        by one, each written whole or not at all; their paths. `FileExistsError` when one is
        there already."""
        req = self.get_profile(job_id, request_id)
        os.makedirs(out, exist_ok=True)
        paths = []
        for f in req.files:
            target = os.path.join(os.fspath(out), os.path.basename(f.name))
            if os.path.exists(target):
                raise FileExistsError(errno.EEXIST, "exists already", target)
            part = target + ".part"
            try:
                with self._http.stream("GET", f"/jobs/{job_id}/profile/{request_id}/files/"
                                       f"{f.name}", timeout=httpx.Timeout(30, read=None)
                                       ) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        raise _refusal(resp, self)
                    with open(part, "wb") as fh:
                        for chunk in resp.iter_bytes(1 << 20):
                            fh.write(chunk)
                if os.path.getsize(part) != f.bytes:
                    raise ConnectionFailed(self.server, f"the trace {f.name} of job {job_id}"
                                           f" came short of its {f.bytes} bytes")
                os.replace(part, target)
            except httpx.HTTPError as exc:
                raise ConnectionFailed(self.server, f"the trace {f.name} of job {job_id} broke"
                                       f" off: {exc or type(exc).__name__}") from None
            finally:
                if os.path.exists(part):
                    os.remove(part)
            paths.append(target)
        return paths

    # -- the cluster and the planner -------------------------------------------------------------

    def get_cluster(self) -> ClusterView:
        """The nodes, the active jobs on each, the newest probe, the calibrated profiles."""
        return self._get(ClusterView, "/cluster")

    def cordon_node(self, host: str, *, reason: str = "") -> Node:
        """No new rank on the node `host` names (its id or a unique prefix, hostname or
        address); admins only. The node as stored."""
        return self._post(Node, f"/nodes/{quote(host, safe='')}/cordon", {"reason": reason})

    def drain_node(self, host: str, *, grace_s: float = 300.0, reason: str = "") -> Node:
        """Cordon the node and move the jobs with ranks there (each saves a checkpoint at its
        next step boundary, within `grace_s`); admins only."""
        return self._post(Node, f"/nodes/{quote(host, safe='')}/drain",
                          {"reason": reason, "grace_s": grace_s})

    def uncordon_node(self, host: str) -> Node:
        """New ranks may be placed on the node again; admins only."""
        return self._post(Node, f"/nodes/{quote(host, safe='')}/uncordon")

    def request_probe(self, *, ranks_per_node: int = 2, max_bytes: int = 64 << 20,
                      profile: str = "cpu") -> Probe:
        """Ask the controller to probe the cluster; poll `get_probe` for the result."""
        return self._post(Probe, "/probes", {"ranks_per_node": ranks_per_node,
                                             "max_bytes": max_bytes, "profile": profile})

    def list_probes(self) -> ProbeList:
        return self._get(ProbeList, "/probes")

    def get_probe(self, probe_id: int) -> Probe:
        return self._get(Probe, f"/probes/{probe_id}")

    def calibrate(self, *, profile: str, jobs: list[int]) -> CalibratedProfileOut:
        """Fit the stack's efficiency and overheads to the succeeded calibration `jobs` and
        store them with the probed `profile` (`trident probe --calibrate`)."""
        return self._post(CalibratedProfileOut, "/calibrations",
                          {"profile": profile, "jobs": jobs})

    def plan(self, spec: JobSpec | Mapping[str, Any], *, top: int = 5
             ) -> PlanOut | LayoutSearch:
        """The planner on the server, nothing submitted: a `PlanOut` for an explicit layout,
        a `LayoutSearch` for `parallel: auto`."""
        body = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else dict(spec)
        if isinstance(spec, JobSpec) and spec.secrets:  # write-only: no dump carries them
            body["secrets"] = spec.secret_values()
        return self._post(PlanOut | LayoutSearch, "/plan", body, params={"top": top})

    # -- identity --------------------------------------------------------------------------------

    def whoami(self) -> WhoAmI:
        """The caller: user, role, projects (the default first), the token used."""
        return self._get(WhoAmI, "/whoami")

    def create_user(self, name: str, *, role: str = "member",
                    projects: list[str] | None = None) -> User:
        return self._post(User, "/users", {"name": name, "role": role,
                                           "projects": projects or []})

    def list_users(self) -> UserList:
        return self._get(UserList, "/users")

    def disable_user(self, name: str) -> User:
        """Disable a user: their tokens are refused from the next request on."""
        return self._post(User, f"/users/{name}/disable")

    def create_token(self, name: str, *, user: str | None = None,
                     expires_in_days: float | None = None) -> NewToken:
        """A new token (for `user`: admins); its secret is in the answer, and only there."""
        body: dict[str, Any] = {"name": name}
        if user:
            body["user"] = user
        if expires_in_days:
            body["expires_in_days"] = expires_in_days
        return self._post(NewToken, "/tokens", body)

    def list_tokens(self, *, user: str | None = None) -> TokenList:
        return self._get(TokenList, "/tokens", user=user)

    def revoke_token(self, token_id: int) -> Token:
        return _parse(Token, self._send("DELETE", f"/tokens/{token_id}"))

    def create_project(self, name: str, *, gpus: float | None = None,
                       cpus: float | None = None, members: list[str] | None = None,
                       max_priority: int | None = None) -> Project:
        return self._post(Project, "/projects", {"name": name, "gpus": gpus, "cpus": cpus,
                                                 "members": members or [],
                                                 "max_priority": max_priority})

    def list_projects(self) -> ProjectList:
        return self._get(ProjectList, "/projects")

    def set_quota(self, project: str, *, gpus: float | None = None,
                  cpus: float | None = None, max_priority: int | None = None) -> Project:
        """Set (or, with None, lift) a project's quota and priority cap (all three)."""
        return _parse(Project, self._send("PUT", f"/projects/{project}/quota",
                                          json={"gpus": gpus, "cpus": cpus,
                                                "max_priority": max_priority}))

    def set_budget(self, project: str, *, gpu_hours: float | None = None,
                   cpu_hours: float | None = None, cost: float | None = None,
                   since: datetime | None = None, stop_running: bool = False) -> Project:
        """Set a project's budget (any of GPU-hours, CPU-hours, money), counted from `since`
        (default: now)."""
        return _parse(Project, self._send("PUT", f"/projects/{project}/budget", json={
            "gpu_hours": gpu_hours, "cpu_hours": cpu_hours, "cost": cost,
            "since": since.isoformat() if since is not None else None,
            "stop_running": stop_running}))

    def remove_budget(self, project: str) -> Project:
        return _parse(Project, self._send("DELETE", f"/projects/{project}/budget"))

    def add_member(self, project: str, user: str) -> Project:
        return self._post(Project, f"/projects/{project}/members", {"user": user})

    def list_audit(self, *, actor: str | None = None, after: int = 0,
                   limit: int = 200) -> AuditList:
        """Requests that changed something (or tried to), oldest first."""
        return self._get(AuditList, "/audit", actor=actor, after=after or None, limit=limit)

    # -- system ----------------------------------------------------------------------------------

    def healthz(self) -> Health:
        """The database and the controller's lease; a `degraded` answer (503) is returned,
        not raised."""
        try:
            r = self._http.get("/healthz")
        except httpx.HTTPError as exc:
            raise ConnectionFailed(self.server, str(exc) or type(exc).__name__) from None
        if r.status_code not in (200, 503):
            raise _refusal(r, self)
        return _parse(Health, r)


def model_json(obj: BaseModel | Any) -> Any:
    """A result as JSON-ready data, as the API sent it (datetimes as pydantic writes them)."""
    return _adapter(type(obj)).dump_python(obj, mode="json")
