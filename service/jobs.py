"""Turning a submitted spec into what is stored: the plan and the resource claim.

Called by the API on submit (and by `trident plan`). Raises ValueError (a 422) when the
job cannot run as asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.parallel import rank_layout
from service.spec import JobSpec


@dataclass(frozen=True)
class Prepared:
    plan: dict[str, Any]
    world_size: int
    cpus: float
    gpus: float


def prepare(spec: JobSpec) -> Prepared:
    if isinstance(spec.parallel, str):
        raise ValueError("parallel: 'auto' needs the planner, which is not available yet")
    layout = spec.parallel
    plan = {
        "layout": {**layout.model_dump(), "micro_batch": spec.train.micro_batch},
        "world_size": layout.dims.world_size,
        "rank_layout": rank_layout(layout.dims, spec.model.layers_, layout.virtual_stages),
    }
    return Prepared(plan=plan, world_size=layout.dims.world_size,
                    cpus=spec.resources.cpus_per_worker, gpus=spec.resources.gpus_per_worker)
