"""`POST /api/v1/plan`: the planner without submitting anything."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request

from api.auth import require
from api.deps import StoreDep, read_hf_configs
from api.schemas import LayoutSearch, PlanOut
from service.cluster.profiles import profile_for
from service.contract.spec import JobSpec
from service.planner import plan_command
from service.planner.job_plan import NOT_PLANNED
from service.planner.search import cpu_bound

router = APIRouter(tags=["plan"])


# Unset fields stay out, so that the answer is the planner's JSON as it made it.
@router.post("/plan", response_model=PlanOut | LayoutSearch, response_model_exclude_unset=True,
             dependencies=[Depends(require("plan")), Depends(read_hf_configs)])
def plan(spec: JobSpec, store: StoreDep, request: Request,
         top: Annotated[int, Query(ge=1, le=100)] = 5) -> dict[str, Any]:
    """Predicted memory and step time: for an explicit layout exactly that layout (even when
    it does not fit, with `fits: false` and the reasons); for `parallel: "auto"` the ranked
    layouts that fit and the rejected ones with their reasons. Every plan carries `ranges`
    (from the planner's held-out error on published runs) and `stages` (each pipeline stage's
    layers, the most loaded and the slowest). When the model fits no layout of its cluster,
    `what_it_takes` lists the smallest cluster of each GPU type that trains it (nodes x GPUs
    per node, best layout, step time, GPU-hours per billion tokens). Uses the profile
    calibrated by `trident probe` when there is one. A request spends at most
    `API_SEARCH_CPU_S` (0.5 s) of CPU in the layout search: a larger search is a 422 saying
    so, and `what_it_takes` that did not fit in it is null with `what_it_takes_error` (`trident
    plan` and `trident capacity` answer locally, unbounded). Where the server prices the
    spec's profile (`TRIDENT_PRICES`), the plan (for `auto`, the best one) carries `cost`:
    its step time x `train.steps` x its ranks at the price per GPU-hour (CPU-hour on CPU
    ranks). A command spec without model is not planned: a 422 naming `model`."""
    if spec.model is None:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", "model"], "type": "value_error",
             "msg": f"model: {NOT_PLANNED}; give model (and parallel) to plan it"}])
    profile = profile_for(store, spec.target.gpu)
    price = request.app.state.settings.prices.get(spec.target.gpu)
    try:
        with cpu_bound():
            out = plan_command(spec, top=top, as_json=True, profile=profile, price=price)
    except ValueError as exc:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", "parallel"], "msg": str(exc), "type": "value_error"}]) from None
    assert isinstance(out, dict)
    return out
