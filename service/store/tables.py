"""Database schema (SQLAlchemy 2): every table is declared here, so that `migrations/env.py`'s
`target_metadata` (Alembic's comparison, `tests/test_migrations_drift.py`) sees them all. Only
the modules of `service.store` query these tables; `migrations/` creates them. The engines
and transactions they are queried through are `service.store.engine`'s.

One module because every table is declared in one place: Alembic's comparison reads this
module's metadata and nothing else, and a foreign key or an index reads beside the table it
refers to.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    cast,
    text,
    type_coerce,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(UTC)


class StoredJSON(TypeDecorator[Any]):
    """JSON that a process decodes once per distinct text: a job's spec and plan (several
    KiB each, never changed once stored) are read on every poll of its page and for every
    line of the jobs list. The decoded values are shared: nothing may change them in place
    (nothing does; a new value is assigned, as SQLAlchemy's JSON needs anyway). It is read
    as text (`column_expression`): PostgreSQL's driver would otherwise decode it on every
    read. The DDL is JSON's."""

    impl = JSON
    cache_ok = True
    CACHE_MAX = 8192

    def column_expression(self, colexpr: Any) -> Any:
        return type_coerce(cast(colexpr, Text), self)

    def result_processor(self, dialect: Dialect, coltype: Any) -> Any:
        processor = self.impl_instance.dialect_impl(dialect).result_processor(dialect,
                                                                              coltype)
        inner: Any = processor or getattr(dialect, "_json_deserializer", None) or json.loads
        cache: dict[str, Any] = {}

        def process(value: Any) -> Any:
            if not isinstance(value, str):
                return inner(value)
            found = cache.get(value)
            if found is None:
                found = inner(value)
                if len(cache) >= self.CACHE_MAX:
                    cache.clear()
                cache[value] = found
            return found

        return process


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


IDEMPOTENCY_KEY_MAX = 255
NAME_MAX = 64
"""Longest user, token and project name."""


class JobRow(Base):
    __tablename__ = "jobs"
    # An idempotency key is its owner's: the same key from two users is two jobs.
    # `ix_jobs_queue` leads with the state, so it serves every filter by state; with the
    # priority and the id in it, the queue's order and a job's place in it (a count of the
    # queued jobs ahead, `service.store.dashboard`) are read from the index alone, never
    # from the jobs' rows.
    __table_args__ = (Index("ix_jobs_owner_idempotency_key", "owner", "idempotency_key",
                            unique=True),
                      Index("ix_jobs_owner", "owner"),
                      Index("ix_jobs_queue", "state", "priority", "id"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    owner: Mapped[str] = mapped_column(String(128), default="local")
    state: Mapped[str] = mapped_column(String(16))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    spec: Mapped[dict[str, Any]] = mapped_column(StoredJSON)
    plan: Mapped[dict[str, Any]] = mapped_column(StoredJSON)
    world_size: Mapped[int] = mapped_column(Integer)
    cpus: Mapped[float] = mapped_column(Float)
    gpus: Mapped[float] = mapped_column(Float)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(IDEMPOTENCY_KEY_MAX),
                                                        nullable=True)
    """The client's `Idempotency-Key` of the submission that created the job (unique per
    owner)."""
    request_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """SHA-256 of the submitted spec, to tell a retry from another request with that key."""
    project: Mapped[str | None] = mapped_column(String(NAME_MAX), nullable=True)
    """The project the job was submitted under (NULL: submitted before projects existed)."""
    waiting: Mapped[str | None] = mapped_column(Text, nullable=True)
    """Why a queued job is not admitted although it could fit (its project's quota)."""
    preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Attempts stopped for a job of higher priority (PREEMPTED -> QUEUED): they spend no
    retry."""
    elastic: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """An elastic job re-planned to another layout (`service.policy.elastic_replan`): the layout it
    was
    submitted with and its moves up (NULL: never re-planned)."""
    ledger: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """An ended job's goodput ledger (`service.store.goodput`), kept once computed (NULL: not
    ended, or not read since; migration 0020)."""


class AttemptRow(Base):
    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("job_id", "number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    placement: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class EventRow(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"),
                                    primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int | None] = mapped_column(Integer, nullable=True)
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class MetricRow(Base):
    __tablename__ = "metrics"
    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "step", "rank"),
        Index("ix_metrics_job_rank_step", "job_id", "rank", "step"),
        # Covers the dashboard's charts: their bucketed min/max reads only this index.
        Index("ix_metrics_series", "job_id", "rank", "step", "attempt", "loss", "step_time_s",
              "tokens_per_s"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"),
                                    primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    step_time_s: Mapped[float] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Global tokens per second (None: not known, a command job without a model whose
    script reports none; migration 0024)."""
    lr: Mapped[float | None] = mapped_column(Float, nullable=True)
    """The learning rate the step ran at (None: a report without one)."""
    grad_norm: Mapped[float | None] = mapped_column(Float, nullable=True)
    """The global gradient norm before clipping (None: not finite, or not reported)."""
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ProbeRow(Base):
    """A collective-bandwidth / matmul probe: of a job's groups, or of the whole cluster."""

    __tablename__ = "probes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    scope: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"),
                                               nullable=True, index=True)
    attempt: Mapped[int | None] = mapped_column(Integer, nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    request: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    results: Mapped[list[Any]] = mapped_column(JSON, default=list)
    summary: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class NodeRow(Base):
    """One node of the live cluster, as the controller last saw it."""

    __tablename__ = "nodes"

    node_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    alive: Mapped[bool] = mapped_column(Boolean, default=True)
    info: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    cordoned_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    """Since when no new rank is placed here (`trident node cordon`, a drain, the lemon rule);
    NULL: schedulable."""
    cordoned_by: Mapped[str | None] = mapped_column(String(255), nullable=True)
    """Who cordoned it: a user's name, or `trident` (the lemon rule)."""
    cordon_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    drain_deadline: Mapped[datetime | None] = mapped_column(DateTime(timezone=True),
                                                            nullable=True)
    """A drain's: by when the jobs with ranks here must have saved and stopped."""
    drained_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    """When the controller saw the drain done: no active job's ranks left here."""
    events: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    """The node's newest events (cordon, drain, drained, uncordon, lemon), oldest first."""
    failures: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    """Failed attempts with ranks here within the lemon rule's window (`Settings.lemon_*`)."""


class ProfileRow(Base):
    """A hardware profile calibrated by a cluster probe; overrides the built-in one of its name."""

    __tablename__ = "profiles"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    probe_id: Mapped[int | None] = mapped_column(ForeignKey("probes.id", ondelete="SET NULL"),
                                                 nullable=True)
    profile: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class LeaseRow(Base):
    """A named lease: who holds it and until when (the controller's leadership)."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    epoch: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), default=1)
    """Incremented whenever the lease changes hands: a fencing token."""
    acquired_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    renewed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_pass_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """How long the holder's previous controller pass took (written with each renewal), for
    `GET /metrics`."""


class UserRow(Base):
    """A person (or service account) who calls the API with tokens; `role` says what they may do."""

    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(NAME_MAX), unique=True)
    role: Mapped[str] = mapped_column(String(16))
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TokenRow(Base):
    """An API token: only its SHA-256 is kept (`hash`, unique: a check is one index look-up)."""

    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(NAME_MAX))
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ProjectRow(Base):
    """A project jobs are submitted under, with its quota of concurrently held resources."""

    __tablename__ = "projects"

    name: Mapped[str] = mapped_column(String(NAME_MAX), primary_key=True)
    gpu_quota: Mapped[float | None] = mapped_column(Float, nullable=True)
    """GPUs its running jobs may hold together (NULL: no limit)."""
    cpu_quota: Mapped[float | None] = mapped_column(Float, nullable=True)
    """CPUs its running CPU-only jobs may hold together (NULL: no limit)."""
    max_priority: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The highest `priority` its members may give a job (NULL: no cap)."""
    budget_gpu_hours: Mapped[float | None] = mapped_column(Float, nullable=True)
    """GPU-hours its jobs may spend from `budget_since` (NULL: no budget; migration 0020)."""
    budget_cpu_hours: Mapped[float | None] = mapped_column(Float, nullable=True)
    """CPU-hours its CPU-only jobs may spend from `budget_since` (NULL: no budget)."""
    budget_cost: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Money its jobs may spend from `budget_since`, at `TRIDENT_PRICES` (NULL: no budget)."""
    budget_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True),
                                                          nullable=True)
    """Since when its budget is counted (set with the budget)."""
    budget_warned_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True),
                                                              nullable=True)
    """When its jobs were warned that 80 % of the budget is spent (NULL: not yet)."""
    budget_stop_running: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    """Whether its running jobs are stopped once the budget is spent (NULL, false: they are
    left to finish; migration 0021)."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class MembershipRow(Base):
    """A user's membership of a project; the lowest id is the user's default project."""

    __tablename__ = "memberships"
    __table_args__ = (UniqueConstraint("user_id", "project"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    project: Mapped[str] = mapped_column(ForeignKey("projects.name", ondelete="CASCADE"))


class AuditRow(Base):
    """One mutating request: who, when, from where, what, and how it ended."""

    __tablename__ = "audit"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"),
                                    primary_key=True, autoincrement=True)
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    actor: Mapped[str | None] = mapped_column(String(NAME_MAX), nullable=True)
    """The user (NULL: the request was not authenticated)."""
    client: Mapped[str | None] = mapped_column(String(64), nullable=True)
    method: Mapped[str] = mapped_column(String(8))
    path: Mapped[str] = mapped_column(String(512))
    action: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """The authorization rule of the route (e.g. `jobs:cancel`)."""
    status: Mapped[int] = mapped_column(Integer)


class JobSecretRow(Base):
    """A secret of a job (`JobSpec.secrets`), sealed with the server's key
    (`service.secrets.SecretBox`): apart from the spec, never returned; the controller
    opens
    it to give it to the ranks' environment."""

    __tablename__ = "job_secrets"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"),
                                        primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    sealed: Mapped[bytes] = mapped_column(LargeBinary)


class CheckpointRow(Base):
    """A checkpoint tag of a job, as its rank 0 reported it (`service.store.checkpoints`):
    its size and layout; `removed_at` once the retention policy deleted it."""

    __tablename__ = "checkpoints"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"),
                                        primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    layout: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """The layout that wrote it (tp, pp, dp, zero, virtual stages, micro-batch)."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    removed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class TrackingExportRow(Base):
    """How far a job's stored steps went to one tracker (`service.tracking`): the cursor
    the exporter goes on from after an outage or a restart, and what it sent and dropped."""

    __tablename__ = "tracking_exports"
    __table_args__ = (Index("ix_tracking_exports_done", "done"),)

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"),
                                        primary_key=True)
    sink: Mapped[str] = mapped_column(String(16), primary_key=True)
    """`mlflow` or `tensorboard`."""
    target: Mapped[str] = mapped_column(String(2048))
    """The MLflow tracking URI, or `tensorboard` (the data directory's, `job-<id>/` in it)."""
    run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """The job's MLflow run (None: not made yet)."""
    experiment_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer, default=0)
    """The cursor: the last (attempt, step) sent or dropped; the next batch starts after it."""
    exported: Mapped[int] = mapped_column(Integer, default=0)
    """Steps sent."""
    dropped: Mapped[int] = mapped_column(Integer, default=0)
    """Steps the tracker refused for good (counted, never sent again)."""
    state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    """The job state the tracker was last told."""
    done: Mapped[bool] = mapped_column(Boolean, default=False)
    """Every step of the ended job and its final state sent: nothing more to do."""
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The newest failure (an outage, a refusal), until a send succeeds."""
    failing_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True),
                                                           nullable=True)
    """When the tracker stopped answering (None: it answers)."""
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


EXTRAS = "eval_s IS NOT NULL OR save_s IS NOT NULL"
"""The steps `ix_step_metrics_extras` holds."""


class StepMetricRow(Base):
    """One optimizer step of one attempt, over all of its ranks (migration 0008)."""

    __tablename__ = "step_metrics"
    # The goodput ledger sums the evaluations and saves of an attempt's steps: only the few
    # steps that had one are in this index, so the sum reads those alone (migration 0020).
    __table_args__ = (Index("ix_step_metrics_extras", "job_id", "attempt", "step",
                            sqlite_where=text(EXTRAS), postgresql_where=text(EXTRAS)),)

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"),
                                        primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    ranks: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    rank_bits: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    step_time_sum: Mapped[float] = mapped_column(Float)
    step_time_sumsq: Mapped[float] = mapped_column(Float)
    step_time_min: Mapped[float] = mapped_column(Float)
    step_time_max: Mapped[float] = mapped_column(Float)
    worst_rank: Mapped[int] = mapped_column(Integer)
    tokens_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """The slowest rank's (None: no rank knew it; migration 0024)."""
    stragglers: Mapped[int] = mapped_column(Integer)
    time: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    lr: Mapped[float | None] = mapped_column(Float, nullable=True)
    """The learning rate of the step (the same on every rank; migration 0015)."""
    grad_norm: Mapped[float | None] = mapped_column(Float, nullable=True)
    """The global gradient norm before clipping (the same on every rank; migration 0015)."""
    eval_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Validation loss of the steps that evaluated (migration 0014; docs/data.md)."""
    tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    """Tokens the job had trained on after the step (migration 0014)."""
    epoch: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Passes over the first training corpus after the step (migration 0014)."""
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    """When the step's optimizer update ended, on its slowest rank's clock (migration 0020)."""
    eval_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Seconds the evaluation after the step took (the longest rank's)."""
    save_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Seconds the checkpoint save after the step blocked the loop (the longest rank's)."""
    load_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """On an attempt's first step: seconds it took to load the checkpoint it resumed from."""
    resumed_from: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The step of the checkpoint the attempt resumed from (0: it started fresh)."""


class StackRequestRow(Base):
    """One request for a job's stacks and, once collected, the answer (migration 0009)."""

    __tablename__ = "stack_requests"
    __table_args__ = (Index("ix_stack_requests_job", "job_id", "id"),
                      Index("ix_stack_requests_status", "status"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The attempt whose ranks answered (set when the controller takes the request)."""
    status: Mapped[str] = mapped_column(String(16))
    requested_by: Mapped[str | None] = mapped_column(String(NAME_MAX), nullable=True)
    result: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """`service.control.stack_collect.group_stacks`: threads, each with its groups of ranks."""
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ProfileRequestRow(Base):
    """One `trident profile` request and, once its ranks answered, the traces stored (their
    files under `service.files.profiles`; migration 0022)."""

    __tablename__ = "profile_requests"
    __table_args__ = (Index("ix_profile_requests_job", "job_id", "id"),
                      Index("ix_profile_requests_status", "status"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The attempt whose ranks were profiled (set when the controller takes the request)."""
    status: Mapped[str] = mapped_column(String(16))
    requested_by: Mapped[str | None] = mapped_column(String(NAME_MAX), nullable=True)
    steps: Mapped[int] = mapped_column(Integer)
    ranks: Mapped[list[int]] = mapped_column(JSON)
    memory: Mapped[bool] = mapped_column(Boolean)
    result: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """`service.control.profile_collect`: the files stored, each rank's steps, the ranks
    without a trace and why."""
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ExportRow(Base):
    """One `trident export`: a job's tag written as a Hugging Face folder by a task on the
    cluster, where it went, its files and size (`service.store.exports`; migration 0023)."""

    __tablename__ = "exports"
    __table_args__ = (Index("ix_exports_job", "job_id", "id"),
                      Index("ix_exports_state", "state"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    """pending, running, done or failed (`client.payloads.ExportState`)."""
    destination: Mapped[str] = mapped_column(Text)
    checkpoint_dir: Mapped[str] = mapped_column(Text)
    max_shard_bytes: Mapped[int] = mapped_column(BigInteger)
    requested_by: Mapped[str | None] = mapped_column(String(NAME_MAX), nullable=True)
    files: Mapped[list[str]] = mapped_column(JSON, default=list)
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class RankHeartbeatRow(Base):
    """One rank's last heartbeat in one attempt (migration 0010)."""

    __tablename__ = "rank_heartbeats"

    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"),
                                        primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    """Wall time (UTC, the controller's clock) of the rank's last heartbeat."""
