"""The planner: predicted memory and step time of TP x PP x DP x ZeRO layouts, search, words.

Pure Python (never imports torch, ray, deepspeed or workers). Called by the control plane
(`trident plan`, `POST /api/v1/plan`, job submission and `parallel: auto`) through the
functions exported here; see docs/planner.md for the model and the plan JSON.
"""

from service.planner.jobs import PlanInfeasible, plan_job
from service.planner.plan import Plan, evaluate, structural_problems
from service.planner.scenario import Scenario, ZeroConfig
from service.planner.search import Rejection, SearchResult, nearest_fitting, search
from service.planner.shape import ModelShape

__all__ = ["ModelShape", "Plan", "PlanInfeasible", "Rejection", "Scenario", "SearchResult",
           "ZeroConfig", "evaluate", "nearest_fitting", "plan_job", "search",
           "structural_problems"]
