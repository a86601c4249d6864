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


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakRss:
    """The peak resident growth of this process from its making (see the module)."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = _status("VmRSS")
        except OSError:
            self.base = None

    def growth(self) -> int | None:
        peak = _status("VmHWM")
        return None if self.base is None or peak is None else max(0, peak - self.base)
