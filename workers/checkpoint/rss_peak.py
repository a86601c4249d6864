"""A process's peak resident memory over a stretch of code, from Linux's /proc: what the
layout-free conversion and load record of what they cost each rank (`meta.json`).

`PeakRss()` resets the kernel's high-water mark of this process (writing 5 to
/proc/self/clear_refs) and notes the resident set then; `growth()` is the high-water mark
since, less that: the most memory the stretch added at once (anonymous and mapped file pages
alike). None where /proc does not allow it (another OS, a sandbox refusing clear_refs).
The reset is the process's: its peak as `getrusage` reports it (the memory monitor's process
peak, `workers.monitor.memory`) counts from there on too.
"""

from __future__ import annotations

from workers.monitor.proc_status import reset_peak, status_kib


class PeakRss:
    """The peak resident growth of this process from its making (see the module)."""

    def __init__(self) -> None:
        rss = status_kib().get("VmRSS") if reset_peak() else None
        self.base = None if rss is None else rss * 1024

    def growth(self) -> int | None:
        peak = status_kib().get("VmHWM")
        return None if self.base is None or peak is None else max(0, peak * 1024 - self.base)
