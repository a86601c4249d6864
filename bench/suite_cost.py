"""What a command costs in CPU, every process it starts counted: the test suite's measure.

    python -m bench.suite_cost [--label NAME] [--out FILE] -- make test

The command runs in a control group of its own (cgroup v1 `cpuacct`, or a v2 group where
the machine has no v1 hierarchy), so the CPU of every process it starts is counted, also
the ones that leave its process tree: Ray's raylet and GCS, the rank actors, `trident up`'s
daemon, Chromium. A watcher that samples `/proc` misses the short-lived ones and double
counts nothing; the group's own counter misses nothing. Needs root (it creates the group).

Prints one JSON line: the label, the command, its exit status, wall seconds, and CPU
seconds in all, user and system. `--out` appends the same line to a file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpuacct")
V2 = Path("/sys/fs/cgroup/unified")
TICKS = os.sysconf("SC_CLK_TCK")


def make_group(name: str) -> Path:
    """A new, empty control group that counts CPU; raises SystemExit when none can be made."""
    for root in (V1, V2):
        if (root / "cgroup.procs").exists():
            group = root / name
            group.mkdir()
            return group
    raise SystemExit("error: no cpuacct or cgroup2 hierarchy under /sys/fs/cgroup")


def read_cpu(group: Path) -> tuple[float, float, float]:
    """(total, user, system) CPU seconds the group has used."""
    if (group / "cpuacct.usage").exists():
        total = int((group / "cpuacct.usage").read_text()) / 1e9
        fields = dict(line.split() for line in (group / "cpuacct.stat").read_text().splitlines())
        return total, int(fields["user"]) / TICKS, int(fields["system"]) / TICKS
    fields = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
    return (int(fields["usage_usec"]) / 1e6, int(fields["user_usec"]) / 1e6,
            int(fields["system_usec"]) / 1e6)


def drain(group: Path, timeout_s: float = 30.0) -> None:
    """Stop what the command left in the group, then remove the group."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.2)
    try:
        group.rmdir()
    except OSError as exc:
        print(f"warning: control group {group} left behind: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("command: missing (put it after --)")
    group = make_group(f"trident-suite-{os.getpid()}")
    try:
        started = time.monotonic()

        def enter() -> None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

        rc = subprocess.call(command, preexec_fn=enter)
        wall = time.monotonic() - started
        # What the command left running still counts until it is stopped.
        total, user, system = read_cpu(group)
    finally:
        drain(group)
    line = json.dumps({
        "label": args.label, "command": " ".join(command), "rc": rc,
        "wall_s": round(wall, 1), "cpu_s": round(total, 1),
        "user_s": round(user, 1), "system_s": round(system, 1),
    })
    print(line)
    if args.out:
        with args.out.open("a") as f:
            f.write(line + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
