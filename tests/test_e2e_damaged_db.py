"""A damaged SQLite database under `trident up`, on real processes and real Ray: a damaged
header and damaged pages are each one line at start (nothing is started); a file damaged
under a running stack answers 503 naming it on the job list, a job, `/` and `/metrics`; and
SIGTERM then stops the controller and the Ray head the stack started (it cannot read which
jobs are active: nothing could re-attach them), without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from service.cluster.rayhead import answers, live_head
from tests.damaged_db import damage_header, damage_pages, fill_jobs, malformed, table_pages
from tests.servers import HTTP, ROOT, free_port
from tests.up import Up, alive

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("damage", ["header", "pages"])
def test_trident_up_refuses_a_damaged_database_in_one_line(tmp_path: Path,
                                                           damage: str) -> None:
    db = tmp_path / "trident.db"
    fill_jobs(db, 200)
    if damage == "header":
        damage_header(db)
    else:
        damage_pages(db, table_pages(db, "jobs"))
    assert malformed(db), "the file is not damaged"
    r = subprocess.run([str(Path(sys.executable).parent / "trident"), "up", "--port",
                        str(free_port())], env={**os.environ, "TRIDENT_DATA_DIR": str(tmp_path)},
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 1, lines
    assert len(lines) == 1, lines
    what = ("DatabaseError: file is not a database" if damage == "header"
            else "PRAGMA quick_check: Page ")
    assert lines[0].startswith(f"error: the database {db} is damaged ({what}"), lines
    assert "backup copy" in lines[0], lines
    assert not (tmp_path / "ray").exists(), "a Ray head was started"


def test_damage_under_a_running_stack_is_503_and_sigterm_stops_what_it_started(
        tmp_path: Path) -> None:
    db = tmp_path / "trident.db"
    [job_id, *_] = fill_jobs(db, 200)
    pages = table_pages(db, "jobs")
    up = Up(tmp_path, free_port(), {"TRIDENT_LEASE_S": "3", "TRIDENT_POLL_INTERVAL_S": "0.2"})
    try:
        up.wait_healthy()
        head = live_head(tmp_path)
        assert head is not None
        started = psutil.Process(up.proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        assert "gcs_server" in names and "service.control.daemon" in names, names

        damage_pages(db, pages)  # under the running API and controller
        assert "malformed" in malformed(db)
        for path in ("/api/v1/jobs", f"/api/v1/jobs/{job_id}", "/", f"/jobs/{job_id}",
                     "/metrics"):
            r = HTTP.get(up.server + path, headers=up.auth, timeout=30)
            assert r.status_code == 503, (path, r.status_code, r.text[:300])
            assert "database is damaged (DatabaseError: database disk image is malformed)" \
                in r.text, (path, r.text[:300])
            kind = ("application/json" if path.startswith("/api/") else
                    "text/plain" if path == "/metrics" else "text/html")
            assert r.headers["content-type"].startswith(kind), (path, r.headers)
    finally:
        out = up.stop()
    # SIGTERM: a clean stop (no traceback), the head stopped although the store could not
    # say whether jobs were active, and nothing the stack started left running.
    assert up.proc.returncode == 0, out
    assert "Traceback" not in out, out
    assert f"the database {db} is damaged" in out and "stopping the Ray head" in out, out
    assert not answers(head), f"the Ray head at {head} still answers"
    # Each ends by itself once its parent has gone (multiprocessing's resource tracker when
    # its last client closes its pipe): a deadline, not an instant.
    _, left = psutil.wait_procs([p for p in started if alive(p.pid)], timeout=60)
    assert not left, [(p.pid, " ".join(p.cmdline())) for p in left if alive(p.pid)]
    log = (tmp_path / "controller.log").read_text()
    assert "Traceback" not in log.split("signal SIGTERM")[-1], log[-3000:]
