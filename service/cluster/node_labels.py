"""What a node tells the cluster about itself: Ray node labels from its inventory, and back.

`trident node start` detects the node (`service.cluster.inventory.node_inventory`) and starts Ray
with these labels (keys under `trident.io/`): `accelerator` (gpu or cpu), `gpus`, `gpu-model`,
`gpu-memory-gib`, `gpu-profile` (the `service.contract.hardware` profile the GPU matches, or the
operator's `--gpu-profile`), `gpu-link` (nvlink: every GPU pair over NVLink; pcie: none;
mixed; none: fewer than two GPUs) and, where a row fits a label value (63 characters), each
row of the GPU link matrix of `nvidia-smi topo -m` (`topo-gpu0`: `X.NV18.NV18...`). The
controller's inventory (`workers.launch.launcher.RayLauncher.inventory`) reads them back with
`node_facts`, so the stored node (`GET /cluster`) says what the node declared when it joined.
Ray validates label values: at most 63 of [A-Za-z0-9._-], starting and ending alphanumeric.
"""

from __future__ import annotations

import re
from typing import Any

from service.contract.hardware import profile_for_gpu

PREFIX = "trident.io/"
_BAD = re.compile(r"[^A-Za-z0-9._-]+")
VALUE_MAX = 63


def label_value(text: str) -> str:
    """`text` as a valid Ray label value (other characters become `-`)."""
    return _BAD.sub("-", text)[:VALUE_MAX].strip("-._")


def gpu_link(topology: dict[str, dict[str, str]] | None) -> str:
    """How the node's GPUs reach each other: nvlink, pcie, mixed, or none (under two GPUs)."""
    gpus = sorted(g for g in (topology or {}) if g.startswith("GPU"))
    links = [topology[a].get(b, "") for a in gpus for b in gpus  # type: ignore[index]
             if a != b]
    if not links:
        return "none"
    nv = [link.startswith("NV") for link in links]
    return "nvlink" if all(nv) else "pcie" if not any(nv) else "mixed"


def node_labels(inv: dict[str, Any], gpu_profile: str | None = None) -> dict[str, str]:
    """The labels of a node with inventory `inv`; `gpu_profile` overrides the detected one."""
    gpus = inv.get("gpus") or []
    labels = {"accelerator": "gpu" if gpus else "cpu", "gpus": str(len(gpus))}
    profile = gpu_profile
    if gpus:
        model, memory = str(inv.get("gpu_model") or gpus[0]["name"]), gpus[0]["memory_bytes"]
        labels.update({"gpu-model": label_value(model),
                       "gpu-memory-gib": str(round(memory / 2**30)),
                       "gpu-link": gpu_link(inv.get("topology"))})
        profile = profile or profile_for_gpu(model, memory)
        matrix = inv.get("topology") or {}
        names = sorted((g for g in matrix if g.startswith("GPU")), key=lambda g: int(g[3:]))
        rows = {g: ".".join(matrix[g].get(h, "") for h in names) for g in names}
        if all(len(r) <= VALUE_MAX and label_value(r) == r for r in rows.values()):
            labels.update({f"topo-{g.lower()}": r for g, r in rows.items()})
    elif profile is None:
        profile = "cpu"
    if profile:
        labels["gpu-profile"] = profile
    return {PREFIX + k: v for k, v in labels.items()}


def node_facts(inv: dict[str, Any], labels: dict[str, str] | None) -> dict[str, Any]:
    """What the stored node adds to its inventory `inv`: its Trident labels (`labels`), the
    hardware `profile` it declared (else the one its GPU matches), its `gpu_link`, and the
    link matrix from the labels when the node's own `nvidia-smi` gave none."""
    ours = {k[len(PREFIX):]: v for k, v in (labels or {}).items() if k.startswith(PREFIX)}
    topology = inv.get("topology")
    rows = {k[len("topo-"):].upper(): v.split(".") for k, v in ours.items()
            if k.startswith("topo-")}
    if not topology and rows:
        names = sorted(rows, key=lambda g: int(g[3:]))
        topology = {g: dict(zip(names, cells, strict=False)) for g, cells in rows.items()}
    gpus = inv.get("gpus") or []
    profile = ours.get("gpu-profile") or (
        profile_for_gpu(str(inv.get("gpu_model") or ""), gpus[0]["memory_bytes"]) if gpus
        else "cpu" if inv.get("accelerator") == "cpu" else None)
    return {"labels": ours, "profile": profile, "topology": topology,
            "gpu_link": ours.get("gpu-link") or gpu_link(topology)}
