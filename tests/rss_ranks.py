"""Test helper: ranks whose C allocator gives every large block back to the system when it is
freed, so that a process's resident memory (`workers.checkpoint.rss_peak`) follows the
tensors it holds.

glibc raises its mmap threshold after each large block freed (up to 32 MB), serving later
blocks from its heap, which it keeps: a rank that freed memory before a stretch of code would
show no growth for what it allocates there. A fixed threshold (`mallopt`) keeps every block
over 128 KiB mapped, unmapped when freed.
"""

from __future__ import annotations

import ctypes
from typing import Any

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def rank_main(*args: Any) -> None:
    """`tests.workers_spawn`'s rank, with the allocator set as the module says."""
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1
    assert libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024) == 1
    from tests.workers_spawn import _rank_main

    _rank_main(*args)
