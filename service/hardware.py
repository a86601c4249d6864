"""Hardware profiles: what one accelerator (or CPU rank) of each kind can do.

The planner reads every constant from this one table; the spec validates `cluster.gpu`
against its names. `trident probe` stores measured profiles that override these on a live
cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator kind, with the links of a typical node built from it."""

    name: str
    peak_flops_bf16: float
    """Dense bf16/fp16 peak FLOP/s per device."""
    peak_flops_fp32: float
    """Dense fp32 (TF32 where the hardware has it) peak FLOP/s per device."""
    memory_bytes: float
    """Device memory in bytes."""
    hbm_bw: float
    """Device memory bandwidth, bytes/s."""
    intra_node_bw: float
    """Achievable per-direction bandwidth between devices of one node, bytes/s."""
    inter_node_bw: float
    """Achievable per-device bandwidth between nodes, bytes/s."""
    intra_node_latency_s: float
    inter_node_latency_s: float
    host_memory_bytes: float
    """Host (CPU) memory per node, bytes."""
    source: str


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in [
        HardwareProfile("v100-32gb", 125e12, 15.7e12, 32 * GB, 900 * GB, 130 * GB, 10.75 * GB,
                        5e-6, 10e-6, 768 * GB, "NVIDIA V100 datasheet; DGX-1"),
        HardwareProfile("a100-40gb", 312e12, 156e12, 40 * GB, 1555 * GB, 230 * GB, 21.5 * GB,
                        5e-6, 10e-6, 1024 * GB, "NVIDIA A100 datasheet; nccl-tests DGX A100"),
        HardwareProfile("a100-80gb", 312e12, 156e12, 80 * GB, 2039 * GB, 230 * GB, 21.5 * GB,
                        5e-6, 10e-6, 2048 * GB, "NVIDIA A100 datasheet; nccl-tests DGX A100"),
        HardwareProfile("h100-80gb", 989e12, 494e12, 80 * GB, 3350 * GB, 370 * GB, 43 * GB,
                        5e-6, 10e-6, 2048 * GB, "NVIDIA H100 SXM datasheet; nccl-tests DGX H100"),
        HardwareProfile("h200", 989e12, 494e12, 141 * GB, 4800 * GB, 370 * GB, 43 * GB,
                        5e-6, 10e-6, 2048 * GB, "NVIDIA H200 datasheet"),
        HardwareProfile("cpu", 50e9, 50e9, 16 * GB, 16 * GB, 1.5 * GB, 1.5 * GB,
                        50e-6, 100e-6, 24 * GB, "this project's 2-core CI machine, gloo on loopback"),
    ]
}


def get_profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; known: {sorted(PROFILES)}") from None
