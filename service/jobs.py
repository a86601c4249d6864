"""Turning a submitted spec into what is stored: the spec that runs, its plan, the claim.

Called by the API on submit. `parallel: "auto"` is resolved here, once: the stored spec
carries the layout and micro-batch the search chose (the plan keeps `chosen_by: search` and
the search summary), so the controller and the workers run the stored spec as it is.
Raises ValueError (a 422) when the job cannot run as asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.hardware import HardwareProfile
from service.planner import plan_job
from service.planner.stored import StoredPlan
from service.spec import JobSpec


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
