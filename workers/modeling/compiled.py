"""`train.compile`: each transformer block's computation compiled with `torch.compile`.

What is compiled is `Block._block` (attention and MLP with their residuals), not the block's
`forward`: the engine's hooks (DeepSpeed's, the pipeline's) stay outside the graph, and the
parameters, their names and the checkpoints are those of the uncompiled model. The block's TP
collectives (`copy_to_tp`, `reduce_from_tp`) are traced or become graph breaks, and run as
they do uncompiled. On CPU inductor generates C++ and builds it with the host's compiler.

Compiling happens in the first step, on its first forward and backward (the graph is traced,
then built): `CompileClock` reads the time torch spent compiling, which the trainer reports
with that step as `compile_s`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.modeling.model import Block


def compile_blocks(model: nn.Module) -> int:
    """Compile every block of `model` in place; the number of blocks compiled."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block._block = torch.compile(block._block, dynamic=False)  # type: ignore[method-assign]
    return len(blocks)


class CompileClock:
    """Seconds torch's compiler has spent in this process, read between steps."""

    def __init__(self) -> None:
        self._seen = self._total()

    @staticmethod
    def _total() -> float:
        from torch._dynamo.utils import compilation_time_metrics
        times: dict[str, Any] = compilation_time_metrics
        # Dynamo's whole compile of a frame (forward and its joint graph) and the backward
        # graph's own compile, which runs in the first backward.
        return sum(sum(times.get(key, ())) for key in ("_compile.compile_inner",
                                                        "compile_fx.<locals>.bw_compiler"))

    def lap(self) -> float:
        """Seconds spent compiling since the last lap (or since the clock started)."""
        now = self._total()
        spent, self._seen = now - self._seen, now
        return spent
