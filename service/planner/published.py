"""Published training runs (`data/published_runs.yaml`) as planner scenarios.

Each run is what a paper or a framework's benchmark table published: the model, the layout,
the GPUs, the batch, and a measurement (step time, TFLOP/s per GPU or tokens/s; memory per
GPU; or an out-of-memory failure). `fit.py` fits the stack and GPU constants to them and
judges the planner on the sources it was not fitted to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from service.contract.hardware import get_profile
from service.contract.presets import PRESETS
from service.contract.spec import ParallelSpec
from service.planner.plan import Plan, assess
from service.planner.scenario import Scenario, ZeroConfig
from service.planner.shape import ModelShape
from service.planner.software_stacks import Stack, get_stack

DATA_PATH = Path(__file__).with_name("data") / "published_runs.yaml"
GIB = float(1 << 30)


@dataclass(frozen=True)
class Run:
    source: str
    id: str
    row: dict[str, Any]

    @property
    def stack(self) -> str:
        return str(self.row["stack"])

    @property
    def gpu(self) -> str:
        return str(self.row["gpu"])

    @property
    def oom(self) -> bool:
        return bool(self.row.get("oom", False))

    @property
    def step_s(self) -> float | None:
        """Seconds per step as published, or derived from the published throughput."""
        r = self.row
        if "step_s" in r:
            return float(r["step_s"])
        tokens = r["global_batch"] * self.shape.seq_len
        if "tokens_per_s" in r:
            return tokens / r["tokens_per_s"]
        if "tokens_per_s_per_gpu" in r:
            return tokens / (r["tokens_per_s_per_gpu"] * r["gpus"])
        if "tflops_per_gpu" in r:
            return megatron96_flops(self.shape, r["global_batch"]) / (
                r["tflops_per_gpu"] * 1e12 * r["gpus"])
        return None

    @property
    def memory_bytes(self) -> float | None:
        r = self.row
        if "memory_gib" in r:
            return float(r["memory_gib"]) * GIB
        if "memory_gb" in r:
            return float(r["memory_gb"]) * 1e9
        return None

    @property
    def memory_kind(self) -> str:
        """`device` (nvidia-smi: everything) or `reserved` (the caching allocator's pool)."""
        return str(self.row.get("memory_kind", "device"))

    @property
    def shape(self) -> ModelShape:
        r = self.row
        base: dict[str, Any] = dict(PRESETS[r["preset"]]) if "preset" in r else {}
        for key in ("layers", "hidden", "heads", "vocab", "seq_len", "ffn_hidden", "kv_heads"):
            if key in r:
                base[key] = r[key]
        swiglu = base.get("activation") == "swiglu"
        positions = base.get("positions", "rotary" if swiglu else "learned")
        return ModelShape(
            layers=base["layers"], hidden=base["hidden"], heads=base["heads"],
            kv_heads=base.get("kv_heads", base["heads"]), vocab=base["vocab"],
            seq_len=base["seq_len"], ffn_hidden=base.get("ffn_hidden", 4 * base["hidden"]),
            swiglu=swiglu, biases=bool(r.get("biases", base.get("biases", not swiglu))),
            layer_norm=base.get("norm", "rmsnorm" if swiglu else "layernorm") == "layernorm",
            positions=positions, tied=bool(base.get("tied", not swiglu)),
            dropout=bool(r.get("dropout", base.get("dropout", not swiglu))))

    def layout(self) -> ParallelSpec:
        r = self.row
        tp, pp = r.get("tp", 1), r.get("pp", 1)
        return ParallelSpec(tp=tp, pp=pp, dp=r["gpus"] // (tp * pp), zero=r.get("zero", 0),
                            recompute=r.get("recompute", "none"),
                            sequence_parallel=r.get("sequence_parallel", False),
                            virtual_stages=r.get("virtual_stages", 1),
                            partition=r.get("partition", "uniform"))

    def scenario(self, constants: Stack | None = None,
                 gpu_efficiency: float | None = None) -> Scenario:
        r = self.row
        gpn = r.get("gpus_per_node", 8)
        profile = get_profile(self.gpu)
        if "device_memory_gb" in r:  # the run's part has more memory than the profile's
            profile = replace(profile, memory_bytes=float(r["device_memory_gb"]) * 1e9)
        return Scenario(
            shape=self.shape, layout=self.layout(), micro_batch=r["micro_batch"],
            global_batch=r["global_batch"], precision=r.get("precision", "bf16"),
            profile=profile, gpus_per_node=min(gpn, r["gpus"]),
            nodes=max(1, r["gpus"] // gpn), zero_cfg=ZeroConfig(), stack=self.stack,
            constants=constants or get_stack(self.stack, fitted=False),
            gpu_efficiency=gpu_efficiency if gpu_efficiency is not None else 1.0,
            flash_attention=r.get("flash_attention"), loss=r.get("loss"))

    def predict(self, constants: Stack | None = None,
                gpu_efficiency: float | None = None) -> Plan:
        return assess(self.scenario(constants, gpu_efficiency), job=self.id)

    def predicted_memory(self, plan: Plan) -> float:
        m = plan.memory
        return m.reserved_by_allocator if self.memory_kind == "reserved" else m.total


def megatron96_flops(shape: ModelShape, global_batch: int) -> float:
    """Megatron's hardware FLOPs per iteration with full recompute (Narayanan et al. 2021):
    96 B s l h^2 (1 + s / 6h + V / 16 l h), the count behind published TFLOP/s per GPU."""
    s, h, L, V = shape.seq_len, shape.hidden, shape.layers, shape.vocab
    return 96.0 * global_batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


@cache
def load_data(path: Path = DATA_PATH) -> tuple[dict[str, dict[str, Any]], tuple[Run, ...]]:
    """(sources by key, runs) of the data file."""
    data = yaml.safe_load(path.read_text())
    sources = data["sources"]
    runs = tuple(Run(source=r["source"], id=r["id"], row=r) for r in data["runs"])
    for run in runs:
        if run.source not in sources:
            raise ValueError(f"run {run.id!r} cites unknown source {run.source!r}")
    return sources, runs


def runs_by_source() -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {}
    for run in load_data()[1]:
        out.setdefault(run.source, []).append(run)
    return out


def is_tuning(source: str) -> bool:
    """Sources the profile was tuned on before this fit (Korthikanti Table 5): never fitted."""
    return bool(load_data()[0][source].get("tuning", False))
