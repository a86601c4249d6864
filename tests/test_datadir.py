"""A data directory belongs to one `trident up`: the lock is exclusive, names its holder to
the one refused, and goes with its process, `kill -9` included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from service.files.datadir import InUse, hold, holder

ROOT = Path(__file__).resolve().parent.parent


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    held = hold(tmp_path)
    try:
        assert holder(tmp_path) == os.getpid()
        with pytest.raises(InUse) as refused:
            hold(tmp_path)  # another open file of the same process: refused all the same
        assert refused.value.pid == os.getpid()
        assert str(refused.value) == (
            f"data dir {tmp_path} is in use by another `trident up` (pid {os.getpid()});"
            " stop it, or give this one another --data-dir")
    finally:
        held.release()
    hold(tmp_path).release()


def test_the_lock_goes_with_a_killed_holder_and_not_to_its_children(tmp_path: Path) -> None:
    """A holder that started a child (as `trident up` starts its Ray head, which outlives
    it) and was killed with SIGKILL: the directory is free although the child lives on."""
    code = (f"import subprocess, sys, time; from service.files.datadir import hold;"
            f" hold(__import__('pathlib').Path({str(tmp_path)!r}));"
            " child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
            " print(child.pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        with pytest.raises(InUse) as refused:
            hold(tmp_path)
        assert refused.value.pid == proc.pid
        proc.kill()
        proc.wait(30)
        assert Path(f"/proc/{child}").exists()  # the child lives on
        hold(tmp_path).release()
    finally:
        proc.kill()
        os.kill(child, signal.SIGKILL)
