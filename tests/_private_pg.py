"""A PostgreSQL server of a test's own (another port, another data directory), which the test
may stop and start without touching the shared one."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.servers import free_port


def _bin() -> Path:
    root = Path("/usr/lib/postgresql")
    versions = sorted(root.iterdir(), key=lambda p: int(p.name)) if root.is_dir() else []
    if not versions:
        raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql")
    return versions[-1] / "bin"


class PrivatePostgres:
    def __init__(self) -> None:
        self.port = free_port()
        # Under /tmp itself: the server's user must reach it (a test's tmp_path is private).
        self.dir = Path(tempfile.mkdtemp(prefix="trident-pg-"))
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.dir / "data"), "-A", "trust", "-U", "postgres",
                  "--no-sync")
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self._as, str(_bin() / tool), *args], check=True, timeout=120,
                       capture_output=True)

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-w",
                  "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "fast", "-w", "stop")

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
