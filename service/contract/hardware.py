"""Hardware profiles: what one accelerator (or CPU rank) of each kind can do.

The planner (`service.planner`) reads every hardware constant from this one table, and the
spec validates `cluster.gpu` against its names. `trident probe` measures a live cluster and
`service.planner.calibrate.profile_from_measurements` turns the measurements into a profile
that overrides these for jobs on that cluster.

Sources (one line per constant family; each profile names its own in `source`):

- Peak dense FLOP/s, memory and HBM bandwidth: NVIDIA datasheets (V100 SXM2, A100 SXM4,
  H100 SXM5, H200 SXM). Device memory is what nvidia-smi shows (an A100 "80GB" holds
  81920 MiB, an H100 81559 MiB, an H200 143771 MiB), not the datasheet's decimal GB;
  bandwidths are decimal GB/s.
- Intra-node bandwidth: achieved 8-GPU all-reduce bus bandwidth from nccl-tests on DGX
  machines (about 130 GB/s V100 NVLink2, 230 GB/s A100 NVLink3, 370 GB/s H100 NVLink4 ring).
- Inter-node bandwidth: one InfiniBand port per GPU (EDR 12.5, HDR 25, NDR 50 GB/s line
  rate) at the 0.86 of line rate that nccl-tests achieves across nodes.
- Host link: PCIe gen3 / gen4 / gen5 x16 achieved copy rate (about 12 / 24 / 50 GB/s).
- GEMM efficiency curve (`gemm_eff_max`, `gemm_half_width`): least squares of the log step
  time over the eight rows of Korthikanti et al. 2022, Table 5 (A100-80GB, TP 8, per-GPU
  widths 768 to 3200), with the planner's time model as it is (its memory-bound element-wise
  term included): `python -m service.planner.fit --curve`, checked by
  tests/test_planner_fit.py. Other GPUs scale the same curve: it models how well a
  transformer layer's GEMMs of per-GPU width h/tp fill the tensor cores.
- CPU Adam: DeepSpeed's CPUAdam reaches about 1e9 parameters/s per 16-32 core socket
  (ZeRO-Offload, Ren et al. 2021, Fig. 7); a DGX node has two sockets.
- `cpu`: measured on one core of a 2-core x86-64 machine (one rank per core): torch matmul
  on one thread for the FLOP/s; gloo all-reduce on loopback for the bandwidth
  (`python bench/bench_probe.py`); the per-layer and per-step overheads fitted to the
  built-in trainer's step times at several depths (`python bench/bench_cpu_trainer.py`, or
  `python bench/bench_cpu_constants.py` for DeepSpeed without Ray). Re-run those on the
  target machine, or calibrate a live cluster with `trident probe`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

GB = 1e9
GiB = 2.0**30
CPU_FRAMEWORK_START_BYTES = 307e6
"""A CPU rank's framework: the own memory (anonymous: `RssAnon` + `RssShmem`) of a rank that
Ray runs (its worker process, Ray's core worker in it) once torch, DeepSpeed, `torch._dynamo`
and the trainer are imported and its gloo process group is up: the trainer's `framework_bytes`
(304-313 MB measured, `pytest -s tests/test_plan_agreement_ray.py`). The library pages its
resident set also maps (140 MB there, more on files the kernel holds in larger pieces) are
the page cache's, not the rank's (`workers.monitor.memory`)."""
CPU_FRAMEWORK_GROWTH_BYTES = 8e6
"""What the framework adds on a CPU rank while it builds the engine and runs the first step,
besides the tensors of the plan's categories: the rank's peak own memory (from the start
above) less the framework at start and the measured categories, 4-13 MB on every layout
family (`python bench/plan_agreement.py --all`)."""
MiB = 2.0**20


@dataclass(frozen=True)
class StackCalibration:
    """A software stack's step-time constants fitted to its own runs on this cluster
    (`trident probe --calibrate`, `service.planner.calibrate.fit_stack`): the efficiency on
    the probed GEMM rate; the per-layer and per-step overheads it fitted are the profile's
    `layer_overhead_s` and `step_overhead_s`."""

    stack: str
    """The stack whose runs were timed (`train.stack`)."""
    efficiency: float
    """Fraction of the profile's GEMM rate (its probed peak x the GEMM curve) the runs reached:
    it replaces the stack's and the GPU's factors fitted to published runs."""
    jobs: tuple[int, ...]
    """The calibration jobs whose measured step times were fitted."""
    at: str
    """When it was fitted (UTC, ISO 8601)."""
    error: float
    """Root mean square of the fit's relative step-time errors on those jobs."""
    precision: str = "bf16"
    """The jobs' training precision: the efficiency holds for plans on the same peak (fp32's,
    or the 16-bit one bf16 and fp16 share); other plans keep the published-run factors."""

    @property
    def source(self) -> str:
        jobs = ", ".join(str(j) for j in self.jobs)
        return f"trident probe --calibrate: {self.stack} jobs {jobs} at {self.at}"

    def covers(self, precision: str) -> bool:
        """Whether a plan in `precision` runs on the peak the jobs measured."""
        return (precision == "fp32") == (self.precision == "fp32")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StackCalibration:
        return cls(stack=str(data["stack"]), efficiency=float(data["efficiency"]),
                   jobs=tuple(int(j) for j in data["jobs"]), at=str(data["at"]),
                   error=float(data["error"]), precision=str(data.get("precision", "bf16")))


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator kind, with the links of a typical node built from it."""

    name: str
    """Profile name, as used by `cluster.gpu`."""
    peak_flops_bf16: float
    """Dense bf16/fp16 peak FLOP/s per device."""
    peak_flops_fp32: float
    """Dense fp32 (TF32 where the hardware has it) peak FLOP/s per device."""
    memory_bytes: float
    """Device memory in bytes (for `cpu`: the share of host memory one rank may use)."""
    hbm_bw: float
    """Device memory bandwidth, bytes/s."""
    intra_node_bw: float
    """Achieved collective bus bandwidth between devices of one node, bytes/s (nccl-tests)."""
    inter_node_bw: float
    """Achieved per-device bandwidth between nodes, bytes/s (one NIC port per device)."""
    intra_node_latency_s: float
    """Per-hop latency alpha of a collective inside a node, seconds."""
    inter_node_latency_s: float
    """Per-hop latency alpha of a collective across nodes, seconds."""
    host_memory_bytes: float
    """Host (CPU) memory per node, bytes."""
    host_link_bw: float = 24 * GB
    """Host <-> device copy bandwidth per device (PCIe), bytes/s; used by CPU offload."""
    gemm_eff_max: float = 0.786
    """Fraction of peak FLOP/s that very wide transformer GEMMs reach."""
    gemm_half_width: float = 258.0
    """Per-GPU GEMM width h/tp at which the efficiency is half of `gemm_eff_max`."""
    cpu_adam_params_per_s: float = 2e9
    """CPU Adam throughput of one node (all sockets), parameters per second."""
    layer_overhead_s: float = 0.0
    """Fixed time per transformer layer per micro-batch, forward plus backward (launches)."""
    step_overhead_s: float = 0.0
    """Fixed time per optimizer step (optimizer launch, bookkeeping)."""
    reserved_bytes: float = 0.6 * GB
    """The CUDA context and kernel images of one process; on `cpu` (no CUDA context) the
    framework's resident memory, measured: `CPU_FRAMEWORK_START_BYTES` +
    `CPU_FRAMEWORK_GROWTH_BYTES`. NCCL buffers, framework buffers and allocator slack are
    added by the planner (service.planner.software_stacks)."""
    nccl_channels: int = 16
    """NCCL channels per communicator (`NCCL_DEBUG=INFO` prints them); buffers are
    channels x peers x a buffer per protocol (software_stacks.nccl_buffer_bytes)."""
    host_process_bytes: float = 4 * GB
    """Host memory each rank's process needs besides offloaded states (runtime, pinned I/O)."""
    device_is_host: bool = False
    """The "device" is the host itself (CPU training): device bytes count against host memory."""
    dp_overlap: float = 0.5
    """Fraction of the data-parallel gradient reduction hidden behind the backward pass."""
    source: str = ""
    """Where the numbers come from."""
    probed: str = ""
    """Which `trident probe` measured the peak FLOP/s and the bus bandwidth, and when (empty:
    datasheet figures)."""
    calibration: StackCalibration | None = None
    """The stack constants its calibration jobs fitted (None: not calibrated)."""

    def peak_flops(self, precision: str) -> float:
        """Dense peak for the training precision (`fp32`, `bf16`, `fp16`)."""
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_bf16

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HardwareProfile:
        cal = data.get("calibration")
        return cls(**{**data, "calibration": None if cal is None
                      else StackCalibration.from_json(cal)})

    def with_(self, **changes: Any) -> HardwareProfile:
        return replace(self, **changes)


_DATASHEET = "NVIDIA {} datasheet; nccl-tests DGX {}; IB {} at 0.86 of line rate; PCIe {}"

PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in [
        HardwareProfile(
            name="v100-32gb", peak_flops_bf16=125e12, peak_flops_fp32=15.7e12,
            memory_bytes=32 * GiB, hbm_bw=900 * GB, intra_node_bw=130 * GB,
            inter_node_bw=10.75 * GB, intra_node_latency_s=6e-6, inter_node_latency_s=12e-6,
            host_memory_bytes=768 * GB, host_link_bw=12 * GB, cpu_adam_params_per_s=1.5e9,
            layer_overhead_s=60e-6, reserved_bytes=0.5 * GB,
            source=_DATASHEET.format("V100 SXM2", "-1", "EDR", "gen3")),
        HardwareProfile(
            name="a100-40gb", peak_flops_bf16=312e12, peak_flops_fp32=156e12,
            memory_bytes=40 * GiB, hbm_bw=1555 * GB, intra_node_bw=230 * GB,
            inter_node_bw=21.5 * GB, intra_node_latency_s=5e-6, inter_node_latency_s=10e-6,
            host_memory_bytes=1024 * GB, host_link_bw=24 * GB,
            layer_overhead_s=40e-6,
            source=_DATASHEET.format("A100 SXM4 40GB", "A100", "HDR", "gen4")),
        HardwareProfile(
            name="a100-80gb", peak_flops_bf16=312e12, peak_flops_fp32=156e12,
            memory_bytes=80 * GiB, hbm_bw=2039 * GB, intra_node_bw=230 * GB,
            inter_node_bw=21.5 * GB, intra_node_latency_s=5e-6, inter_node_latency_s=10e-6,
            host_memory_bytes=2048 * GB, host_link_bw=24 * GB,
            layer_overhead_s=40e-6,
            source=_DATASHEET.format("A100 SXM4 80GB", "A100", "HDR", "gen4")),
        HardwareProfile(
            name="h100-80gb", peak_flops_bf16=989e12, peak_flops_fp32=494e12,
            memory_bytes=81559 * MiB, hbm_bw=3350 * GB, intra_node_bw=370 * GB,
            inter_node_bw=43 * GB, intra_node_latency_s=4e-6, inter_node_latency_s=8e-6,
            host_memory_bytes=2048 * GB, host_link_bw=50 * GB, cpu_adam_params_per_s=3e9,
            layer_overhead_s=30e-6, reserved_bytes=0.7 * GB,
            source=_DATASHEET.format("H100 SXM5", "H100", "NDR", "gen5")),
        HardwareProfile(
            name="h200", peak_flops_bf16=989e12, peak_flops_fp32=494e12,
            memory_bytes=143771 * MiB, hbm_bw=4800 * GB, intra_node_bw=370 * GB,
            inter_node_bw=43 * GB, intra_node_latency_s=4e-6, inter_node_latency_s=8e-6,
            host_memory_bytes=2048 * GB, host_link_bw=50 * GB, cpu_adam_params_per_s=3e9,
            layer_overhead_s=30e-6, reserved_bytes=0.7 * GB,
            source=_DATASHEET.format("H200 SXM", "H200", "NDR", "gen5")),
        # One rank = one core of a 2-core x86-64 machine. Step times of tiny models are
        # dominated by per-op overheads, so the overhead constants matter more than the FLOP/s.
        HardwareProfile(
            name="cpu", peak_flops_bf16=200e9, peak_flops_fp32=93e9,
            memory_bytes=8 * GB, hbm_bw=16 * GB, intra_node_bw=1.5 * GB,
            inter_node_bw=1.5 * GB, intra_node_latency_s=50e-6, inter_node_latency_s=100e-6,
            host_memory_bytes=24 * GB, host_link_bw=16 * GB, gemm_eff_max=0.9,
            gemm_half_width=64.0, cpu_adam_params_per_s=2e8, layer_overhead_s=2.2e-3,
            step_overhead_s=10.5e-3,
            reserved_bytes=CPU_FRAMEWORK_START_BYTES + CPU_FRAMEWORK_GROWTH_BYTES,
            dp_overlap=0.0,
            host_process_bytes=0.5 * GB, device_is_host=True,
            source="one core of a 2-core x86-64 machine: one-thread torch matmul 93 GFLOP/s"
                   " fp32, 200 bf16; gloo loopback all-reduce busbw 1.5 GB/s"
                   " (bench/bench_probe.py); per-layer and per-step overheads fitted to the"
                   " built-in trainer run through Ray with the monitor on"
                   " (bench/bench_cpu_trainer.py)"),
    ]
}


def get_profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; known: {sorted(PROFILES)}") from None


def profile_for_gpu(model: str, memory_bytes: float) -> str | None:
    """The profile of a GPU as NVML or `nvidia-smi` names it (`NVIDIA H100 80GB HBM3`), with
    its memory; None for a GPU no profile describes. `trident node start` labels nodes with
    it, and the controller's inventory records it (`service.cluster.node_labels`)."""
    name, gib = model.lower(), memory_bytes / 2**30
    if "h200" in name:
        return "h200"
    if "h100" in name:
        return "h100-80gb"
    if "a100" in name:
        return "a100-80gb" if gib > 60 else "a100-40gb"
    if "v100" in name and gib > 20:
        return "v100-32gb"
    return None
