"""Environment of one rank: the spec's `env` plus the settings that make NCCL fail, not hang.

The Ray worker group calls `rank_env(spec.env, on_gpu)` and applies the result to each rank's
environment before `torch.distributed.init_process_group(..., timeout=pg_timeout(...))`.

PyTorch 2.13 names (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp):
- TORCH_NCCL_ASYNC_ERROR_HANDLING=3 is the library default (SkipCleanUp: the watchdog aborts
  the process, no communicator clean-up); 1 (TearDown) aborts the communicators and then the
  process. We set 1 so that a NCCL error or a collective past the process-group `timeout`
  kills the rank, the actor dies, and the controller applies the failure policy.
- TORCH_NCCL_BLOCKING_WAIT=1 would make `wait()` raise instead; it blocks the CPU thread on
  every collective, so it stays off.
- TORCH_NCCL_ENABLE_MONITORING=1 with TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: a monitor thread
  kills the process when the watchdog itself is stuck (for example in a hung CUDA call).
- TORCH_NCCL_DUMP_ON_TIMEOUT with TORCH_NCCL_TRACE_BUFFER_SIZE > 0 records the flight recorder
  of the last collectives on a timeout (what each rank last launched).
Values the user set in the spec win. On CPU (gloo) only the spec's env is passed; gloo has no
watchdog and relies on the `timeout` of init_process_group.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

NCCL_DEFAULTS: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}
# Old spellings PyTorch still reads; a user setting either one keeps ours away.
_ALIASES = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "NCCL_ASYNC_ERROR_HANDLING"}


def rank_env(spec_env: Mapping[str, str], on_gpu: bool) -> dict[str, str]:
    """The spec's env with the NCCL failure settings added where the user left them unset."""
    env = dict(spec_env)
    if on_gpu:
        for key, value in NCCL_DEFAULTS.items():
            if key not in env and _ALIASES.get(key) not in env:
                env[key] = value
    return env


def pg_timeout(hang_timeout_s: float) -> timedelta:
    """`timeout=` for init_process_group: past the controller's hang timeout, so the
    controller diagnoses a hang (with stacks) before the watchdog kills the rank."""
    return timedelta(seconds=max(60.0, 2 * hang_timeout_s))
