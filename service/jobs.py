"""Turning a submitted spec into what is stored: the plan and the resource claim.

Called by the API on submit and on `POST /plan`; the controller calls `effective_spec` to
run the layout the plan chose. Raises ValueError (a 422) when the job cannot run as asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.hardware import HardwareProfile
from service.planner import plan_job
from service.spec import JobSpec, ParallelSpec


@dataclass(frozen=True)
class Prepared:
    plan: dict[str, Any]
    world_size: int
    cpus: float
    gpus: float


def prepare(spec: JobSpec, profile: HardwareProfile | None = None) -> Prepared:
    """Plan the job (search it for `parallel: auto`); PlanInfeasible if it cannot fit."""
    plan = plan_job(spec, profile=profile)
    return Prepared(plan=plan, world_size=int(plan["world_size"]),
                    cpus=spec.resources.cpus_per_worker, gpus=spec.resources.gpus_per_worker)


def effective_spec(spec: JobSpec, plan: dict[str, Any]) -> JobSpec:
    """The spec the workers run: `parallel: auto` replaced by the planned layout."""
    if not isinstance(spec.parallel, str):
        return spec
    layout = dict(plan["layout"])
    micro_batch = int(layout.pop("micro_batch"))
    data = spec.model_dump(mode="json")
    data["parallel"] = ParallelSpec.model_validate(layout).model_dump(mode="json")
    data["train"]["micro_batch"] = micro_batch
    return JobSpec.model_validate(data)
