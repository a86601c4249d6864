"""What a rank reports: one `StepReport` per optimizer step, on every rank.

The trainer (`workers.train`) builds them; the worker group forwards them to the controller,
which stores them. Custom entrypoints report through the same callable and should send at
least the required keys.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict


class MemoryReport(TypedDict):
    """Bytes this rank really holds, measured (see `workers.memory`)."""

    params_bytes: int
    """Parameter storages the rank holds: its TP/PP shard, or its ZeRO-3 partition, plus any
    staging copy DeepSpeed keeps (bf16 copy for optimizer offload)."""
    grads_bytes: int
    """Gradient storages right after the optimizer step (ZeRO-2/3: the rank's partition plus
    DeepSpeed's reduction buffers)."""
    optimizer_bytes: int
    """Optimizer states: Adam moments, step counters and fp32 master weights of the rank's
    partition."""
    activations_peak_bytes: int
    """Peak bytes of tensors saved for backward so far (saved-tensor hooks)."""
    process_peak_bytes: int
    """Peak RSS of the process (CPU) or `torch.cuda.max_memory_allocated` (GPU)."""
    process_peak_source: Literal["rss_peak", "cuda_max_allocated"]


class StepReport(TypedDict):
    kind: Literal["step"]
    rank: int
    step: int
    """1-based optimizer step."""
    loss: float
    """Mean loss over the global batch; the same value on every rank."""
    step_time_s: float
    tokens_per_s: float
    """Global tokens (global_batch * seq_len) per second of this rank's step time."""
    memory: MemoryReport
    tp_rank: NotRequired[int]
    pp_rank: NotRequired[int]
    dp_rank: NotRequired[int]
    attempt: NotRequired[int]
    resumed_from: NotRequired[int]
    """Step of the checkpoint this attempt resumed from (0: started fresh)."""
    checkpoint: NotRequired[str | None]
    """Directory of the checkpoint saved after this step, if any."""
