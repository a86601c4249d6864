"""Cluster routes: the node inventory the controller records, and `trident probe` runs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from api.auth import require
from api.deps import ProbeId, StoreDep
from api.schemas import ClusterView, ProbeList
from service.contract.hardware import PROFILES
from service.store import NotFound, Probe, Store

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
