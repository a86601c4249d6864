"""What the control plane stores for a job: `plan_job`, and `PlanInfeasible`.

Called at submission through `service.submission.intake.prepare` (the API turns `PlanInfeasible`
into a 422), which writes the layout the search chose for `parallel: "auto"` into the stored spec.
A command job without `model` is not planned: its stored plan is its placement only
(`placement_json`).
"""

from __future__ import annotations

from typing import Any

from service.contract.hardware import GB, HardwareProfile
from service.contract.parallel import rank_layout
from service.contract.spec import JobSpec
from service.planner.explain import layout_name
from service.planner.plan import Plan, evaluate
from service.planner.scenario import ZeroConfig
from service.planner.search import SearchTooLarge, nearest_fitting, search
from service.planner.stored import plan_json


class PlanInfeasible(ValueError):
    """No layout to run: the explicit one does not fit, or (auto) none does."""

    def __init__(self, message: str, *, plan: Plan | None = None,
                 nearest: list[Plan] | None = None, reasons: list[str] | None = None) -> None:
        super().__init__(message)
        self.plan = plan
        self.nearest = nearest or []
        self.reasons = reasons or []


def plan_job(spec: JobSpec, *, profile: HardwareProfile | None = None,
             zero_cfg: ZeroConfig | None = None) -> dict[str, Any]:
    """The plan JSON stored with a job (docs/planner.md); raises PlanInfeasible.

    `profile`: a probed profile for the job's cluster (default: `cluster.gpu`'s table entry);
    `zero_cfg`: the trainer's DeepSpeed bucket settings (default: DeepSpeed's defaults).
    A job without a model gets its placement only (`placement_json`).
    """
    if spec.model is None:
        return placement_json(spec)
    if isinstance(spec.parallel, str):
        res = search(spec, profile=profile, zero_cfg=zero_cfg)
        if res.best is None:
            reasons = sorted({r.reason for r in res.rejected})
            raise PlanInfeasible(
                f"no layout of {res.world_size} ranks fits on {res.profile}: "
                + "; ".join(reasons[:6]), reasons=reasons)
        out = plan_json(res.best)
        out["chosen_by"] = "search"
        out["search"] = {
            "considered": res.considered, "fitting": len(res.ranked),
            "rejected": len(res.rejected),
            "top": [p.summary() | {"name": layout_name(p)} for p in res.ranked[:5]],
            "explanation": res.explanation(),
        }
        return out
    plan = evaluate(spec, profile=profile, zero_cfg=zero_cfg)
    if not plan.fits:
        try:
            nearest = nearest_fitting(spec, spec.layout, profile=profile, zero_cfg=zero_cfg)
            alts = ("; nearest layouts that fit: " + ", ".join(
                f"{layout_name(p)} ({p.memory.total / GB:.1f} GB, {p.tokens_per_s:,.0f}"
                " tokens/s)" for p in nearest)) if nearest else (
                "; no layout of this world size fits")
        except SearchTooLarge as exc:
            nearest, alts = [], f"; nearest layouts not searched: {exc}"
        raise PlanInfeasible(
            f"layout {layout_name(plan)} does not fit: " + "; ".join(plan.reasons) + alts,
            plan=plan, nearest=nearest, reasons=plan.reasons)
    out = plan_json(plan)
    out["chosen_by"] = "spec"
    return out


NOT_PLANNED = ("not planned: a command job without model, placed from resources alone"
               " (resources.workers data-parallel ranks); no memory check, no predicted step")
"""Why a job's plan holds no prediction (its `why`)."""


def placement_json(spec: JobSpec) -> dict[str, Any]:
    """The stored plan of a job that is not planned (no `model`): `planned: false`, the
    ranks it runs (`resources.workers`, data-parallel) and their rows, and no prediction:
    no `time`, `memory`, `tokens_per_s` nor `mfu`, which the readers show as not planned."""
    dims = spec.layout.dims
    return {"planned": False, "why": NOT_PLANNED, "world_size": dims.world_size,
            "layout": spec.layout.model_dump() | {"micro_batch": spec.train.micro_batch},
            "rank_layout": rank_layout(dims, [[] for _ in range(dims.pp)]),
            "chosen_by": "resources"}
