"""Turning a submitted spec into what is stored: the spec that runs, its plan, the claim.

`submit` is what `POST /api/v1/jobs` does (the benchmarks and tests submit through it too).
`parallel: "auto"` is resolved here, once: the stored spec
carries the layout and micro-batch the search chose (the plan keeps `chosen_by: search` and
the search summary), so the controller and the workers run the stored spec as it is.
Raises ValueError (a 422) when the job cannot run as asked, including when no placement of
its TP-group bundles exists on the nodes the controller last recorded (the API never asks
Ray; with no nodes recorded yet the scheduler decides later, as for any job).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from service.cluster.data_plane import NodeCapacity
from service.cluster.profiles import profile_for
from service.contract.hardware import HardwareProfile
from service.contract.spec import JobSpec, SpecError
from service.files.data_check import CheckSlots, check_data
from service.planner import plan_job
from service.planner.shape import ModelShape
from service.planner.stored import StoredPlan
from service.policy.scheduler import bundles, pack
from service.secrets import SecretBox
from service.store import Job, KeyTaken, Node, Store
from service.submission.confine import Confinement
from service.tracking.config import TrackingConfig


@dataclass(frozen=True)
class Prepared:
    spec: JobSpec
    """The spec to store and run: explicit layout, even when `parallel: auto` was asked."""
    plan: StoredPlan
    world_size: int
    cpus: float
    gpus: float


def prepare(spec: JobSpec, profile: HardwareProfile | None = None) -> Prepared:
    """Plan the job (search it for `parallel: auto`); PlanInfeasible if it cannot fit."""
    plan = StoredPlan.from_json(plan_job(spec, profile=profile))
    return Prepared(spec=resolve(spec, plan), plan=plan, world_size=plan.world_size,
                    cpus=spec.resources.cpus_per_worker, gpus=spec.resources.gpus_per_worker)


def resolve(spec: JobSpec, plan: StoredPlan) -> JobSpec:
    """`spec` with `parallel: auto` replaced by the plan's layout and micro-batch."""
    if not isinstance(spec.parallel, str):
        return spec
    data = spec.model_dump()
    data["parallel"] = plan.layout.parallel.model_dump()
    data["train"]["micro_batch"] = plan.layout.micro_batch
    # Validated again: the chosen layout must pass the spec's own consistency checks.
    return JobSpec.model_validate(data)


class KeyReused(ValueError):
    """An idempotency key sent again with another spec than the one that created its job."""

    def __init__(self, key: str, job: Job) -> None:
        super().__init__(f"idempotency key {key!r} was used for job {job.id} with another"
                         " spec; send a new key for a new job")
        self.job = job


def request_hash(spec: JobSpec) -> str:
    """SHA-256 of the spec as validated: key order, spacing and defaults do not count. Of
    its secrets, the names count (never a value: the hash is stored)."""
    data = spec.model_dump(mode="json")
    if spec.secrets:
        data["secrets"] = sorted(spec.secrets)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Submitter:
    """Who submits, under which project, and the limits their spec must keep."""

    owner: str = "local"
    project: str | None = None
    confinement: Confinement | None = None
    tracking: TrackingConfig | None = None
    """The server's trackers: which the job goes to, and which MLflow servers it may name."""
    box: SecretBox | None = None
    """Seals the spec's `secrets` for the store (None: a spec with secrets is refused)."""
    checks: CheckSlots | None = None
    """How many corpus checks may run at once (None: no bound; the API's are its settings)."""
    data_dir: Path | None = None
    """The server's data directory, where corpus scans are recorded (None: a corpus no record
    describes is scanned at submission, whatever its size; `service.files.data_check`)."""


def submit_once(store: Store, spec: JobSpec, key: str,
                by: Submitter | None = None) -> tuple[Job, bool]:
    """`submit` under an idempotency key of `by.owner`: the job (and True) when this call
    created it; the job an earlier submission of that owner with `key` created (and False)
    when the spec is the same; KeyReused when it is not. Keys are scoped to their owner:
    another user's job with the same key is never returned."""
    by = by or Submitter()
    digest = request_hash(spec)

    def earlier(job: Job, digest_then: str | None) -> tuple[Job, bool]:
        if digest_then != digest:
            raise KeyReused(key, job)
        return job, False

    if (found := store.job_by_idempotency_key(owner=by.owner, key=key)) is not None:
        return earlier(*found)
    try:
        return submit(store, spec, idempotency_key=key, digest=digest, by=by), True
    except KeyTaken as taken:  # a concurrent retry created it first
        return earlier(taken.job, taken.request_hash)


def submit(store: Store, spec: JobSpec, *, idempotency_key: str | None = None,
           digest: str | None = None, by: Submitter | None = None) -> Job:
    """Plan `spec` with the profile this cluster plans with and queue it, owned by `by`.
    PlanInfeasible (a ValueError) if it cannot fit; a SpecError on the field that reaches
    outside the job (`by.confinement`), on `tracking.mlflow` if it names an MLflow server
    the server does not allow, on `model` if it would run the built-in trainer and that would
    build another model than the one planned, or on `resources` if no placement of its ranks
    exists on the recorded nodes. The spec's `secrets` are sealed (`by.box`) and stored
    apart from it; the stored spec holds none."""
    by = by or Submitter()
    if by.confinement is not None:
        by.confinement.check(spec)
    # After confinement: no file outside the data roots is read.
    spec = check_data(spec, by.checks, by.owner, by.data_dir)
    if spec.secrets and by.box is None:
        raise SpecError("secrets", "this server keeps no secrets")
    sealed = by.box.seal_all(spec.secret_values()) if by.box is not None else {}
    prepared = prepare(spec, profile_for(store, spec.target.gpu))
    if spec.entrypoint is None and spec.command is None and (
            refusal := ModelShape.from_spec(spec.planned_model).builtin_trainer_refusal()):
        raise SpecError("model", refusal)
    unplaceable = placement_refusal(prepared, store.list_nodes())
    if unplaceable is not None:
        raise unplaceable
    return store.create_job(name=spec.name, spec=prepared.spec,
                            plan=prepared.plan, world_size=prepared.world_size,
                            cpus=prepared.cpus, gpus=prepared.gpus, priority=spec.priority,
                            owner=by.owner, project=by.project,
                            idempotency_key=idempotency_key, request_hash=digest,
                            secrets=sealed, tracking=by.tracking.targets(spec.tracking)
                            if by.tracking is not None else None)


def capacities(nodes: list[Node]) -> list[NodeCapacity]:
    """The CPUs and GPUs of the alive nodes whose Ray resources the controller recorded."""
    out = []
    for n in nodes:
        res = n.info.get("resources")
        if n.alive and isinstance(res, dict):
            out.append(NodeCapacity(n.node_id, float(res.get("CPU") or 0),
                                    float(res.get("GPU") or 0)))
    return out


def placement_refusal(job: Prepared, nodes: list[Node]) -> SpecError | None:
    """Why the job's bundles (one per TP group) could never be placed on `nodes`, naming the
    field to change and the cluster's largest node; None when they fit, or no node is known."""
    caps = capacities(nodes)
    if not caps:
        return None
    items = bundles(job)
    if pack(items, caps) is not None:
        return None
    tp, bundle, groups = job.plan.layout.tp, items[0], len(items)
    big_cpu, big_gpu = max(c.cpus for c in caps), max(c.gpus for c in caps)
    largest = max(caps, key=lambda c: (c.gpus, c.cpus) if bundle.gpus else (c.cpus, c.gpus))
    claim = (f"a TP group of tp({tp}) ranks claims {bundle.cpus:g} CPUs and {bundle.gpus:g}"
             f" GPUs on one node; the largest of the cluster's {len(caps)} node(s) has"
             f" {largest.cpus:g} CPUs / {largest.gpus:g} GPUs")
    if bundle.cpus > big_cpu + 1e-9:
        return SpecError("resources.cpus_per_worker", claim)
    if bundle.gpus > big_gpu + 1e-9:
        return SpecError("resources.gpus_per_worker", claim)
    total_cpu, total_gpu = sum(c.cpus for c in caps), sum(c.gpus for c in caps)
    return SpecError("resources", f"{groups} TP group(s) of tp({tp}) ranks, each claiming"
                     f" {bundle.cpus:g} CPUs and {bundle.gpus:g} GPUs on one node, fit nowhere"
                     f" together on the cluster's {len(caps)} node(s) ({total_cpu:g} CPUs,"
                     f" {total_gpu:g} GPUs; the largest node {largest.cpus:g} CPUs /"
                     f" {largest.gpus:g} GPUs)")
