"""Keeps the controller daemon running: `trident up` starts it through a `Supervisor`, which
starts it again whenever it exits (crash, kill, or a lost lease), with backoff.

The backoff doubles from `backoff_min_s` to `backoff_max_s` and starts over once a process has
run `stable_s`, so a daemon that dies at start-up does not spin, and one that ran for hours is
back within a second. Every start and exit is a line in the controller's log (a file, or
stderr for `trident controller`, whose output a container runtime or systemd collects). `stop`
sends SIGTERM (the daemon stops its loop and releases its lease), then SIGKILL to the
process's group after a grace (each process is started in a session of its own).

Supervision survives its own log: a line the disk refuses (a full data directory) is counted
and said once a line goes through again (`service.files.diskfull`), a callback or a start that
fails is logged and retried with the backoff, so the loop itself never ends but by `stop`.

The same class keeps the embedded default's Ray head up (`service.cluster.rayhead`): there
`running_elsewhere` says whether a head started earlier (by a `trident up` that was killed)
still runs, which is then watched, not started twice.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from service.files.diskfull import Refused

log = logging.getLogger("trident.supervisor")

NOTICE_EVERY_S = 5.0
"""While the process runs, how often lines the log's disk refused are said again, once it
takes them."""


def wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """`proc`'s exit status, or None while it still runs after `timeout_s`. Blocks on a
    pidfd, which the kernel makes readable when the process ends: `Popen.wait` with a timeout
    asks every 50 ms instead, 20 wake-ups a second for each supervised process for as long as
    the stack runs. Where there are no pidfds (not Linux), `Popen.wait` it is. `poll(2)`, not
    `select(2)`: a descriptor numbered 1024 or above, in a process with many files open, is
    out of `select`'s range."""
    if (code := proc.poll()) is not None:
        return code
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
    try:
        waiter = select.poll()
        waiter.register(fd, select.POLLIN)
        ready = waiter.poll(timeout_s * 1000)
    finally:
        os.close(fd)
    return proc.wait() if ready else None


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid`, stopped ones included. A supervised process
    leads a session of its own (`Supervisor._spawn`), which is the pid it was given, and
    what it starts stays in it: its process group is not enough, as Ray's workers take
    groups of their own. Linux keeps a pid from reuse while a session bears it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sid, signal.SIGKILL)
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:  # no /proc (not Linux): the group it is
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getsid(pid) == sid:
                os.kill(pid, signal.SIGKILL)


class Supervisor:
    def __init__(self, argv: Sequence[str], *, env: dict[str, str], log_path: Path | None,
                 backoff_min_s: float = 1.0, backoff_max_s: float = 30.0,
                 stable_s: float = 60.0,
                 on_start: Callable[[int], None] | None = None,
                 name: str = "controller",
                 running_elsewhere: Callable[[], bool] | None = None) -> None:
        self.argv = list(argv)
        self.name = name
        self.running_elsewhere = running_elsewhere
        self.env = env
        self.log_path = log_path
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.stable_s = stable_s
        self.on_start = on_start
        self.starts = 0
        """Processes started so far (1 + restarts)."""
        self.exits: list[int] = []
        """Exit status of every process that ended by itself."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.refused = Refused("line")
        """Lines of this supervisor's that the log's disk refused, not yet said."""
        self._partial = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-supervisor",
                                        daemon=True)

    @property
    def pid(self) -> int | None:
        proc = self.proc
        return None if proc is None else proc.pid

    def start(self) -> None:
        self._thread.start()

    def _note(self, message: str) -> None:
        """A line in the supervised process's log, in the daemon's format; a line the disk
        refuses is counted, and said before the next one that goes through (an empty
        `message`: only that)."""
        if message:
            log.info(message)
        if self.log_path is None:  # the log is this process's stderr, where `log` writes
            return
        stamp = datetime.now(UTC).astimezone().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
        notice = self.refused.notice()
        lines = ("" if notice is None else f"{stamp} {log.name} {notice[0]}") + \
            ("" if not message else f"{stamp} {log.name} {message}\n")
        data = ("\n" if self._partial else "").encode() + lines.encode()
        lost = 1 if message else 0
        try:
            with self.log_path.open("ab", buffering=0) as f:  # one write(2), no buffer
                written = f.write(data)
        except OSError as exc:
            self.refused.add(lost, exc)
            return
        self._partial = written < len(data)  # the disk filled during the write
        if self._partial:
            self.refused.add(lost, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        elif notice is not None:
            self.refused.said(notice[1])

    def _open_log(self, path: Path) -> IO[bytes] | None:
        try:
            return path.open("ab")
        except OSError as exc:  # its output is lost, not the process
            self._note(f"cannot open {path} ({exc.strerror}): {self.name} starts without it")
            return None

    def _spawn(self) -> subprocess.Popen[bytes] | None:
        with self._lock:
            if self._stop.is_set():
                return None
            # Its own session: a Ctrl-C at the terminal reaches `trident up` only, which then
            # stops the daemon through `stop` (one shutdown path, not two).
            if self.log_path is None:  # inherit stdout and stderr
                self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True)
            else:
                out = self._open_log(self.log_path)
                try:
                    self.proc = subprocess.Popen(self.argv, env=self.env,
                                                 stdout=out or subprocess.DEVNULL,
                                                 stderr=subprocess.STDOUT,
                                                 start_new_session=True)
                finally:
                    if out is not None:
                        out.close()
            self.starts += 1
            return self.proc

    def _loop(self) -> None:
        backoff = self.backoff_min_s
        while not self._stop.is_set():
            try:
                ran = self._run_once(backoff)
            except Exception as exc:  # a start that failed (no memory, no pids): again later
                log.debug("supervising %s failed", self.name, exc_info=True)
                self._note(f"starting {self.name} failed ({type(exc).__name__}: {exc});"
                           f" trying again in {backoff:g} s")
                ran = 0.0
            if ran is None:
                return
            if ran >= self.stable_s:
                backoff = self.backoff_min_s
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, self.backoff_max_s)

    def _run_once(self, backoff: float) -> float | None:
        """Start the process (or watch the one running elsewhere) and wait for its end; how
        long it ran, or None when stopped."""
        if self.running_elsewhere is not None and self.running_elsewhere():
            self._note(f"{self.name} already running: watching it")
            while self.running_elsewhere():
                if self._stop.wait(2):
                    return None
            self._note(f"{self.name} started earlier is gone: starting one")
        proc = self._spawn()
        if proc is None:
            return None
        began = time.monotonic()
        self._note(f"{self.name} pid {proc.pid} started (start {self.starts})")
        if self.on_start is not None:
            try:
                self.on_start(proc.pid)
            except Exception:  # e.g. the terminal's file is on the full disk too
                log.exception("%s pid %s: on_start failed", self.name, proc.pid)
        while (code := wait_exit(proc, NOTICE_EVERY_S)) is None:
            if self.refused.count:  # say what the disk refused as soon as it can
                self._note("")
        ran = time.monotonic() - began
        if self._stop.is_set():
            return None
        self.exits.append(code)
        self._note(f"{self.name} pid {proc.pid} exited with status {code} after"
                   f" {ran:.1f} s; restarting in"
                   f" {self.backoff_min_s if ran >= self.stable_s else backoff:g} s")
        return ran

    def signal_stop(self) -> None:
        """Stop restarting, and send the running process SIGTERM, once (a second one would
        reach it in its shutdown, where a handler of Ray's, for one, raises `SystemExit`);
        returns at once (`stop` waits). `trident up` calls it when its own signal arrives,
        so that the controller stops beside the API rather than after it."""
        with self._lock:
            first = not self._stop.is_set()
            self._stop.set()
            proc = self.proc
        if first and proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()

    def kill(self) -> None:
        """Stop restarting, and SIGKILL the process and whatever it started now: every
        process of the session it was given (`_spawn`, `kill_session`), stopped (SIGSTOP)
        ones included."""
        with self._lock:
            self._stop.set()
            proc = self.proc
        if proc is not None:
            kill_session(proc.pid)

    def stop(self, grace_s: float = 30.0) -> bool:
        """Stop restarting, and stop the running process: SIGTERM, then, once it has ended
        or `grace_s` is over, SIGKILL to whatever is left of its session (what it started
        that outlived it: a Ray head's processes when `ray start` was killed). Returns
        within `grace_s` and a second, whatever the process does; whether it ended by
        itself (False: it was killed)."""
        deadline = time.monotonic() + grace_s
        self.signal_stop()
        proc = self.proc
        ended = True
        if proc is not None:
            if wait_exit(proc, max(0.0, deadline - time.monotonic())) is None:
                ended = False
                self._note(f"{self.name} pid {proc.pid} did not stop in {grace_s:.1f} s: killed")
            self.kill()
            wait_exit(proc, 1.0)  # reaped: a stopped process ends at SIGKILL too
        self._thread.join(max(0.1, min(5.0, deadline - time.monotonic())))
        return ended


def run_controller(env: dict[str, str], grace_s: float = 30.0) -> int:
    """`trident controller`: the daemon under a Supervisor, logging to stderr, until SIGTERM or
    SIGINT; then it is stopped as `trident up` stops it. The production shape (one per
    container or host, any number of them: the lease lets one act and keeps the others
    standby); the container runtime restarts this process if it ever ends."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr, force=True)
    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        log.info("signal %s: stopping the controller", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # The daemon stops by itself should this process die without stopping it (kill -9).
    env = {**env, "TRIDENT_PARENT_PID": str(os.getpid())}
    sup = Supervisor([sys.executable, "-m", "service.control.daemon"], env=env, log_path=None)
    sup.start()
    while not stop.wait(1.0):
        pass
    sup.stop(grace_s)
    return 0
