"""This process's memory as Linux's /proc reports it: the one reader of /proc/self/status and
writer of /proc/self/clear_refs for the trainer's memory monitor (`workers.monitor.memory`),
the layout-free form's peak records (`workers.checkpoint.rss_peak`), the scripts that start
ranks by hand and the benchmarks.

`status_kib()` is every kB field of /proc/self/status (`VmRSS`: resident now, `VmHWM`: its
peak; `RssAnon`, `RssFile`, `RssShmem`: the resident set's parts), empty where /proc is absent
(another OS). `reset_peak()` resets `VmHWM` to the resident set now (clear_refs 5), so that a
peak read afterwards is what came since; False where that is refused (a sandbox).
"""

from __future__ import annotations


def status_kib() -> dict[str, int]:
    """The kB fields of /proc/self/status, in KiB ({} where it cannot be read)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0])
    except (OSError, ValueError):
        return {}
    return out


def reset_peak() -> bool:
    """Reset this process's peak resident set to the current one; whether the kernel let it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
