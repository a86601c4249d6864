"""Test helper: processes for ranks, forked from a server that imported the trainer once.

A spawned rank imports torch and DeepSpeed again (several CPU-seconds each, and the suite starts
a few hundred ranks). These processes are forked from a fork server (`multiprocessing`'s
"forkserver") whose server imported `workers.trainer.train` when it started, once per test process:
a rank's process starts in milliseconds. A forked process starts from the server's state, not the
test's: `process` gives it the test's environment as it is when the process is made, and the
target's module is imported in the child as with spawn.

On a machine with CUDA the processes are spawned as before: DeepSpeed picks its accelerator at
import, which in the server would decide it for every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["workers.trainer.train", "torch._dynamo"]
"""What the server imports: the trainer (torch, DeepSpeed), and `torch._dynamo`, which every
rank's first optimizer imports (torch's `Optimizer.add_param_group` is wrapped in
`torch._disable_dynamo`, which imports it on its first call): about 1.5 s of CPU per rank on
this kind of machine."""


def context() -> Any:
    """The multiprocessing context of the ranks (see the module's docstring)."""
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Read when the server starts (once per test process); later calls change nothing.
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _with_env(env: dict[str, str], target: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def process(ctx: Any, target: Callable[..., Any], args: tuple = (), **kwargs: Any) -> Any:
    """`ctx.Process(target=target, args=args)`, run in this process's current environment."""
    return ctx.Process(target=_with_env, args=(dict(os.environ), target, args), **kwargs)
