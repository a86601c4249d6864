"""Cluster routes: the node inventory the controller records, its nodes' cordon and drain
(`trident node cordon|drain|uncordon`, admins only), and `trident probe` runs and the
calibration that follows it (`trident probe --calibrate`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field

from api.auth import Principal, require
from api.deps import ProbeId, StoreDep
from api.schemas import CalibratedProfileOut, ClusterView, ProbeList, Refusal
from service.contract.hardware import PROFILES
from service.monitor.calibration import CalibrationRefused, calibrate_stack
from service.store import Node, NotFound, Probe, Store
from service.store.cluster import AmbiguousNode

router = APIRouter(tags=["cluster"])
_READ = [Depends(require("cluster:read"))]


@router.get("/cluster", response_model=ClusterView, dependencies=_READ)
def cluster(store: StoreDep) -> dict[str, Any]:
    """Nodes (GPU model, memory and link matrix on GPU nodes; CPU otherwise; the labels and
    profile `trident node start` declared), the active jobs on each node (`jobs`: node id ->
    job id, name, owner, state, attempt and its ranks there), the newest cluster probe, and
    the profiles that probes calibrated."""
    probes = store.list_probes(scope="cluster", limit=1)
    calibrated = {name: p.to_json() for name in PROFILES if (p := store.get_profile(name=name))}
    return {"nodes": store.list_nodes(), "jobs": jobs_per_node(store),
            "probe": probes[0] if probes else None, "profiles": calibrated}


def jobs_per_node(store: Store) -> dict[str, list[dict[str, Any]]]:
    """Node id -> the active jobs whose newest attempt placed ranks there, with those ranks."""
    out: dict[str, list[dict[str, Any]]] = {}
    for job in store.active_jobs():
        attempts = store.list_attempts(job_id=job.id)
        ranks: dict[str, list[int]] = {}
        for r in (attempts[-1].placement.get("ranks", []) if attempts else []):
            ranks.setdefault(str(r.get("node_id", "")), []).append(int(r["rank"]))
        for node_id, on_node in ranks.items():
            out.setdefault(node_id, []).append({
                "job_id": job.id, "name": job.name, "owner": job.owner,
                "state": job.state.value, "attempt": attempts[-1].number,
                "ranks": sorted(on_node)})
    return out


HOST_MAX = 255
REASON_MAX = 500
DRAIN_GRACE_MAX_S = 86400.0
Host = Annotated[str, Path(min_length=1, max_length=HOST_MAX, pattern=r"^[A-Za-z0-9._:-]+$",
                           description="A node: its id, a unique prefix of its id, its hostname"
                           " or its address, as `trident cluster` shows them.")]


class CordonRequest(BaseModel):
    """Why a node is cordoned (`trident node cordon`)."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    reason: Annotated[str, Field(max_length=REASON_MAX)] = ""
    """Why, for the others (shown by `trident cluster` and the dashboard)."""


class DrainRequest(CordonRequest):
    """A drain (`trident node drain`): cordon, and move the jobs with ranks there."""

    grace_s: Annotated[float, Field(ge=0, le=DRAIN_GRACE_MAX_S)] = 300.0
    """How long the jobs with ranks there get to save their checkpoint and stop, from the
    controller's ask at their next step boundary; those that have not stopped by then are
    stopped, and resume from their newest checkpoint."""


def _node(store: Store, host: str) -> Node:
    try:
        return store.find_node(host)
    except NotFound as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    except AmbiguousNode as exc:
        raise HTTPException(status_code=422, detail=[{
            "loc": ["path", "host"], "type": "value_error", "msg": str(exc)}]) from None


def _reason(body: CordonRequest, what: str) -> str:
    return body.reason.strip() or f"{what} with no reason given"


@router.post("/nodes/{host}/cordon", response_model=Node)
def cordon_node(store: StoreDep, host: Host,
                who: Annotated[Principal, Depends(require("nodes:cordon"))],
                body: CordonRequest = CordonRequest()) -> Node:  # noqa: B008  # immutable
    """No new rank is placed on the node from the controller's next pass; the jobs there run
    on. A node cordoned already stays as it was. The node, as stored."""
    node = _node(store, host)
    return store.cordon_node(node_id=node.node_id, by=who.name, reason=_reason(body, "cordoned"))


@router.post("/nodes/{host}/drain", response_model=Node,
             responses={409: {"model": Refusal, "description": "The node is dead"}})
def drain_node(store: StoreDep, host: Host,
               who: Annotated[Principal, Depends(require("nodes:drain"))],
               body: DrainRequest = DrainRequest()) -> Node:  # noqa: B008  # immutable
    """Cordon the node, then ask every job with ranks there to save a checkpoint at its next
    step boundary and stop; each is requeued (no retry spent) and resumes from that
    checkpoint on the other nodes. The node's state is `draining` until none is left there,
    then `drained`."""
    node = _node(store, host)
    if not node.alive:
        raise HTTPException(status_code=409, detail=f"node {node.node_id[:12]} is dead: its"
                            " jobs moved when it was lost; nothing to drain")
    return store.cordon_node(node_id=node.node_id, by=who.name,
                             reason=_reason(body, "drained"), drain_grace_s=body.grace_s)


@router.post("/nodes/{host}/uncordon", response_model=Node)
def uncordon_node(store: StoreDep, host: Host,
                  who: Annotated[Principal, Depends(require("nodes:uncordon"))]) -> Node:
    """New ranks may be placed on the node again (a drain in progress asks no more jobs to
    move; those asked already move). The lemon rule counts its failures afresh."""
    node = _node(store, host)
    return store.uncordon_node(node_id=node.node_id, by=who.name)


class ProbeRequest(BaseModel):
    """What `trident probe` measures."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    ranks_per_node: Annotated[int, Field(ge=1, le=64)] = 2
    """Ranks on every node: its GPUs on GPU nodes; on CPU nodes, ranks sharing its cores."""
    max_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 64 << 20
    """Largest message size; sizes run from 1 KiB in powers of 4."""
    profile: Annotated[str, Field(max_length=64)] = "cpu"
    """The hardware profile the measurement calibrates (e.g. a100-80gb, cpu)."""


@router.post("/probes", status_code=202, dependencies=[Depends(require("cluster:probe"))])
def request_probe(body: ProbeRequest, store: StoreDep) -> Probe:
    """Ask the controller to probe the cluster; poll `GET /probes/{id}` for the result."""
    if body.profile not in PROFILES:
        raise HTTPException(status_code=422, detail=[{
            "loc": ["body", "profile"], "type": "value_error",
            "msg": f"unknown hardware profile {body.profile!r}; known: {sorted(PROFILES)}"}])
    return store.create_probe(scope="cluster", request=body.model_dump())


@router.get("/probes", response_model=ProbeList, dependencies=_READ)
def list_probes(store: StoreDep) -> dict[str, Any]:
    return {"items": store.list_probes(scope="cluster", limit=50)}


@router.get("/probes/{probe_id}", dependencies=_READ)
def get_probe(store: StoreDep, probe_id: ProbeId) -> Probe:
    try:
        return store.get_probe(probe_id=probe_id)
    except NotFound as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None


class CalibrationRequest(BaseModel):
    """What `trident probe --calibrate` fits after the probe."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    profile: Annotated[str, Field(max_length=64)] = "cpu"
    """The probed profile whose stack constants the jobs measure."""
    jobs: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=3, max_length=8)]
    """The succeeded calibration jobs (`service.planner.calibrate.calibration_specs`): their
    step times fit the efficiency and the per-layer and per-step overheads."""


@router.post("/calibrations", response_model=CalibratedProfileOut,
             dependencies=[Depends(require("cluster:probe"))],
             responses={404: {"model": Refusal, "description": "No probe has calibrated the"
                              " profile on this cluster: run `trident probe` first"}})
def calibrate(body: CalibrationRequest, store: StoreDep) -> dict[str, Any]:
    """Fit the stack's efficiency and overheads to the calibration jobs' measured step times
    and store them with the profile the probe calibrated: plans on this cluster then mark them
    `measured` (`constants` in the plan JSON). 404 when the profile has not been probed here."""
    if body.profile not in PROFILES:
        raise HTTPException(status_code=422, detail=[{
            "loc": ["body", "profile"], "type": "value_error",
            "msg": f"unknown hardware profile {body.profile!r}; known: {sorted(PROFILES)}"}])
    try:
        saved = calibrate_stack(store, profile=body.profile, job_ids=body.jobs)
    except CalibrationRefused as exc:
        if exc.field == "profile":
            raise HTTPException(status_code=404, detail=str(exc)) from None
        raise HTTPException(status_code=422, detail=[{
            "loc": ["body", exc.field], "type": "value_error", "msg": str(exc)}]) from None
    return saved.to_json()
