"""Bandwidth arithmetic as nccl-tests defines it: busbw factors, algbw, busbw, and the busbw
a hardware profile predicts.

Imported by the workers (`workers.monitor.comm_probe` measures with it,
`workers.monitor.comm_timer` counts
bytes the same way) and by the rest of `service.monitor`; pure Python.

Byte counts follow nccl-tests: the size S of an all-gather is the gathered (output) tensor, of
a reduce-scatter the full input tensor, of an all-reduce / broadcast / send / recv the tensor.
algbw = S / time; busbw = algbw * factor(op, n) (see docs/planner-model.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from service.contract.hardware import HardwareProfile

P2P_OPS = frozenset({"send", "recv", "send_recv"})
"""Point-to-point operations: a pair of ranks, busbw = algbw."""


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor of `op` over `n` ranks."""
    if n < 1:
        raise ValueError(f"group size {n} must be positive")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce") or op in P2P_OPS:
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def algbw(nbytes: float, time_s: float) -> float:
    """Algorithm bandwidth in bytes/s (nccl-tests: size / time)."""
    if time_s <= 0:
        raise ValueError(f"time {time_s} s must be positive")
    return nbytes / time_s


def busbw(op: str, n: int, nbytes: float, time_s: float) -> float:
    """Bus bandwidth in bytes/s, comparable across ops and group sizes."""
    return algbw(nbytes, time_s) * busbw_factor(op, n)


def _latency_steps(op: str, n: int) -> int:
    """Sequential latency terms of the ring algorithm (alpha count of the alpha-beta model)."""
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in P2P_OPS:
        return 1
    return n - 1


def expected_busbw(op: str, n: int, nbytes: float, profile: HardwareProfile, *,
                   cross_node: bool) -> float:
    """busbw the ring alpha-beta model predicts for `op` of `nbytes` over `n` ranks.

    time = steps * alpha + factor * S / BW, so busbw = factor * S / time: latency-bound at small
    sizes, tending to the link bandwidth BW at large ones.
    """
    bw = profile.inter_node_bw if cross_node else profile.intra_node_bw
    alpha = profile.inter_node_latency_s if cross_node else profile.intra_node_latency_s
    factor = busbw_factor(op, n)
    if factor == 0:  # a group of one moves nothing
        return 0.0
    time_s = _latency_steps(op, n) * alpha + factor * nbytes / bw
    return factor * nbytes / time_s


def crosses_nodes(group: Iterable[int], node_of_rank: Mapping[int, str] | None) -> bool:
    """Whether the ranks of `group` sit on more than one node (False without a placement)."""
    if node_of_rank is None:
        return False
    return len({node_of_rank[r] for r in group}) > 1
