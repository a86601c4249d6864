"""The planner: predicted memory and step time of TP x PP x DP x ZeRO layouts, search, words.

Pure Python (never imports torch, ray, deepspeed or workers). Called by the control plane
(`trident plan`, `POST /api/v1/plan`, job submission and `parallel: auto`) through the
functions exported here; see docs/planner.md for the model and the plan JSON.
"""

from service.planner.calibrate import fit_overheads, profile_from_measurements
from service.planner.capacity import CanTrain, CapacityRow, can_train, capacity
from service.planner.job_plan import PlanInfeasible, plan_job
from service.planner.plan import Plan, evaluate, structural_problems
from service.planner.report import plan_command, render_plan, render_search
from service.planner.scenario import Scenario, ZeroConfig
from service.planner.search import (
    Rejection,
    SearchResult,
    SearchTooLarge,
    nearest_fitting,
    search,
)
from service.planner.shape import ModelShape
from service.planner.stored import StoredPlan

__all__ = ["CanTrain", "CapacityRow", "ModelShape", "Plan", "PlanInfeasible", "Rejection",
           "Scenario", "SearchResult", "SearchTooLarge", "StoredPlan", "ZeroConfig", "can_train",
           "capacity",
           "evaluate", "fit_overheads", "nearest_fitting", "plan_command", "plan_job",
           "profile_from_measurements", "render_plan", "render_search", "search",
           "structural_problems"]
