"""Node inventory: what one node has (CPUs, memory, GPUs and the links between them).

Called once per node by the Ray worker group (one actor per node, or rank 0 of each node) and
by `trident cluster` / the controller's cluster refresh; the result is stored and served by
`GET /api/v1/cluster`, and `service.monitor.placement.tp_placement_warnings` reads its `topology`.

GPU facts come from NVML (pynvml, when installed) or `nvidia-smi`; the link matrix from
`nvidia-smi topo -m`. A node without either reports `"accelerator": "cpu"`.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from typing import Any

import psutil

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DEVICE = re.compile(r"^(GPU|NIC)\d+$")


def parse_topo_matrix(text: str) -> dict[str, dict[str, str]]:
    """`nvidia-smi topo -m` as {device: {device: link}} over GPU and NIC rows and columns.

    Links: X (self), NV# (NVLink, # links), PIX / PXB (PCIe switch), PHB (host bridge),
    NODE (across host bridges in one NUMA node), SYS (across sockets).
    """
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    if not lines:
        return {}
    header = [c.strip() for c in lines[0].split("\t")]
    cols = [(i, c) for i, c in enumerate(header) if _DEVICE.match(c)]
    matrix: dict[str, dict[str, str]] = {}
    for ln in lines[1:]:
        cells = [c.strip() for c in ln.split("\t")]
        if not cells or not _DEVICE.match(cells[0]):
            if ln.startswith("Legend"):
                break
            continue
        # Rows carry the row label in cell 0, then one cell per header column after the blank
        # first header cell, so header index i lines up with row index i.
        matrix[cells[0]] = {name: cells[i] for i, name in cols if i < len(cells)}
    return matrix


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def _gpus_nvml() -> list[dict[str, Any]] | None:
    try:
        import pynvml  # optional dependency
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            gpus.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                         "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(h).total)})
        pynvml.nvmlShutdown()
        return gpus
    except Exception:  # NVML present but no driver: fall back to nvidia-smi
        return None


def _gpus_smi() -> list[dict[str, Any]] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = _run(["nvidia-smi", "--query-gpu=index,name,memory.total",
                "--format=csv,noheader,nounits"])
    if not out:
        return None
    gpus = []
    for ln in out.strip().splitlines():
        idx, name, mem_mib = (c.strip() for c in ln.split(","))
        gpus.append({"index": int(idx), "name": name, "memory_bytes": int(mem_mib) * 2**20})
    return gpus


def node_inventory() -> dict[str, Any]:
    """This node's inventory, JSON-ready."""
    inv: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
    }
    gpus = _gpus_nvml() or _gpus_smi()
    if not gpus:
        inv.update(accelerator="cpu", gpus=[], topology=None)
        return inv
    topo = _run(["nvidia-smi", "topo", "-m"]) if shutil.which("nvidia-smi") else None
    inv.update(accelerator="gpu", gpu_model=gpus[0]["name"], gpus=gpus,
               topology=parse_topo_matrix(topo) if topo else None)
    return inv
