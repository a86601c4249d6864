"""Turning a submitted spec into what is stored: the spec that runs, its plan, the claim.

`submit` is what `POST /api/v1/jobs` does (the benchmarks and tests submit through it too).
`parallel: "auto"` is resolved here, once: the stored spec
carries the layout and micro-batch the search chose (the plan keeps `chosen_by: search` and
the search summary), so the controller and the workers run the stored spec as it is.
Raises ValueError (a 422) when the job cannot run as asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.hardware import HardwareProfile
from service.planner import plan_job
from service.planner.shape import ModelShape
from service.planner.stored import StoredPlan
from service.profiles import profile_for
from service.spec import JobSpec, SpecError
from service.store import Job, Store


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


def submit(store: Store, spec: JobSpec) -> Job:
    """Plan `spec` with the profile this cluster plans with and queue it. PlanInfeasible (a
    ValueError) if it cannot fit; a SpecError on `model` if it would run the built-in trainer
    and that would build another model than the one planned."""
    prepared = prepare(spec, profile_for(store, spec.target.gpu))
    refusal = ModelShape.from_spec(spec.model).builtin_trainer_refusal()
    if spec.entrypoint is None and refusal:
        raise SpecError("model", refusal)
    return store.create_job(name=spec.name, spec=prepared.spec.model_dump(mode="json"),
                            plan=prepared.plan, world_size=prepared.world_size,
                            cpus=prepared.cpus, gpus=prepared.gpus, priority=spec.priority)
