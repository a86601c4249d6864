"""TP placement: warnings for TP groups placed across a slow link.

Called by the per-attempt health (`service.monitor.attempt`) once the placement is known, with
the node inventory (`service.cluster.inventory`, its `topology` link matrix on GPU nodes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

FAST_LINK_PREFIXES = ("NV", "X")
"""`nvidia-smi topo -m` link kinds counted as fast: NVLink (NV#) and self (X)."""


def tp_placement_warnings(tp_groups: Sequence[Sequence[int]], node_of_rank: Mapping[int, str],
                          gpu_of_rank: Mapping[int, int] | None = None,
                          inventory: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """Warnings for TP groups placed across a slow link.

    A TP group spanning nodes always warns (TP collectives sit on the critical path). Inside a
    GPU node whose inventory carries a topology matrix (`service.cluster.inventory`), a pair of the
    group's GPUs joined by PCIe or the inter-socket bus (PIX, PXB, PHB, NODE, SYS) warns.
    """
    out = []
    for group in tp_groups:
        nodes = sorted({node_of_rank[r] for r in group})
        if len(nodes) > 1:
            out.append(f"TP group {list(group)} spans nodes {nodes}: TP traffic crosses the "
                       f"inter-node network")
            continue
        if gpu_of_rank is None or inventory is None:
            continue
        matrix = (inventory.get(nodes[0], {}).get("topology") or {})
        slow = []
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                ga, gb = f"GPU{gpu_of_rank[a]}", f"GPU{gpu_of_rank[b]}"
                link = matrix.get(ga, {}).get(gb)
                if link and not link.startswith(FAST_LINK_PREFIXES):
                    slow.append(f"{ga}-{gb} {link}")
        if slow:
            out.append(f"TP group {list(group)} on node {nodes[0]} crosses slow links: "
                       + ", ".join(slow))
    return out
