"""DeepSpeed, imported once per process without the MLflow import it does not need.

`import deepspeed` reaches `deepspeed.autotuning.autotuner`, which tries `import mlflow` at
import time to log autotuning runs. Trident never runs DeepSpeed's autotuner, but MLflow is
installed beside it (Trident's own tracking sink, `service.tracking.mlflow_sink`), and importing
it costs every rank process about 3 s of CPU on this kind of machine: half of DeepSpeed's
import (measured with `python -X importtime`, 6.3 s of user time against 3.3 s). Here MLflow is
hidden for the length of DeepSpeed's import only (a `None` entry in `sys.modules` makes
`import mlflow` raise `ImportError`, which the autotuner catches), then the entry is removed:
anything that imports MLflow afterwards (Trident's sink, a user's entrypoint) gets it as usual.

DeepSpeed's shared-memory all-reduce for CPU ranks (`deepspeed_shm_comm`) is switched off here.
DeepSpeed builds it the first time a process initialises its communication backend: a C++
extension compiled with the machine's compiler into `~/.cache/torch_extensions`, under a lock
file that torch waits on without a deadline. It serves only `inference_all_reduce` (inference
and AutoTP's inference layers; training goes through `torch.distributed`'s all-reduce), yet
every CPU rank paid for the build (tens of seconds on a fresh machine) and a rank killed while
building (kill -9, a cancelled job, a test's time-out) left the lock behind, so that every
later rank on the machine hung in `deepspeed.initialize`. With the op marked unavailable,
DeepSpeed's own fallback (`TorchBackend.shm_comm_op` is None) is taken.

DeepSpeed's Muon optimizer is stood in for, too. Whatever optimizer a job uses, DeepSpeed's
engine and its ZeRO optimizers look for Muon: `is_zero_supported_optimizer` and the ZeRO
optimizers import `deepspeed.runtime.zero.muon.muon_optimizer` to check whether the optimizer
is a `MuonWithAuxAdam`, and ZeRO 1-2's gradient epilogue and ZeRO 3 import `muon_update` from
`original_muon` before they check whether a parameter uses it. `original_muon`'s kernels are
decorated with `torch.compile` at import, which imports torch's inductor compiler: about 1.7 s
of CPU per rank on this kind of machine, a fifth of all that a rank of the tiny ZeRO-2 job
spends (7.2 s against 8.9 s, the mean of four ranks; found with py-spy). Trident never
configures Muon (its optimizer is AdamW: `service.contract.ds_config`), so both modules are
replaced by
stand-ins: `MuonWithAuxAdam` is a class that no optimizer is an instance of, so every such
check is False as it is for the real class, and `muon_update`/`adam_update` raise if ever
called (only a parameter of a Muon optimizer reaches them). A process that imported the real
modules before this one keeps them.

Trident's modules take DeepSpeed from here (`from workers.runtime.deepspeed_import import
deepspeed`)
and reach its submodules as attributes, so that whichever of them a process imports first, the
import goes through this module.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def _import_deepspeed() -> ModuleType:
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        return importlib.import_module("deepspeed")
    finally:
        if hide and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


SHM_OP = "deepspeed_shm_comm"
"""DeepSpeed's name for its CPU shared-memory all-reduce op (`ShareMemCommBuilder.NAME`)."""


def _without_shm_op(ds: ModuleType) -> None:
    """Mark the shared-memory op unavailable: `deepspeed.comm.torch.build_shm_op` then returns
    None instead of compiling and loading it."""
    compatible = ds.ops.__compatible_ops__  # probed once per process, then kept
    compatible[SHM_OP] = False


MUON = "deepspeed.runtime.zero.muon"
"""DeepSpeed's package of its Muon optimizer: `muon_optimizer` (`MuonWithAuxAdam`) and
`original_muon` (its compiled kernels, `muon_update`, `adam_update`)."""


class NoMuon:
    """Stands for DeepSpeed's `MuonWithAuxAdam` in a process that never builds one."""


def _no_muon_update(*args: object, **kwargs: object) -> None:
    raise RuntimeError("DeepSpeed's Muon is not available in Trident's ranks"
                       " (workers.runtime.deepspeed_import)")


def _without_muon() -> None:
    """Put modules without Muon's kernels where DeepSpeed's engine looks for Muon."""
    names: dict[str, dict[str, object]] = {
        "muon_optimizer": {"MuonWithAuxAdam": NoMuon},
        "original_muon": {"MuonWithAuxAdam": NoMuon, "muon_update": _no_muon_update,
                          "adam_update": _no_muon_update}}
    for name, attrs in names.items():
        full = f"{MUON}.{name}"
        if full not in sys.modules:
            stand_in = ModuleType(full, "DeepSpeed's Muon, never used by Trident's ranks"
                                        " (workers.runtime.deepspeed_import).")
            stand_in.__dict__.update(attrs)
            sys.modules[full] = stand_in


deepspeed = _import_deepspeed()
_without_shm_op(deepspeed)
_without_muon()
