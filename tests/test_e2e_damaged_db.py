"""A damaged SQLite database under `trident up`, on real processes and real Ray: a damaged
header and damaged pages are each one line at start (nothing is started); a file damaged
(its header or its pages) under a running stack answers 503 naming it on the job list, a job,
`/` and `/metrics`; and SIGTERM then ends `trident up` and every process it started (the
API, the controller, the Ray head's processes) within the stop's grace, measured from the
signal, stopping the head since it cannot read which jobs are active (nothing could
re-attach them), in one line and without a traceback."""

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
from tests.up import Up
from tests.waiting import wait_for

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


GRACE_S = 12.0
"""The stop's grace these stacks run with (`TRIDENT_STOP_GRACE_S`)."""


@pytest.mark.parametrize("damage", ["header", "pages"])
def test_damage_under_a_running_stack_is_503_and_sigterm_stops_what_it_started(
        tmp_path: Path, damage: str) -> None:
    """The header or the pages damaged under the running API and controller, whose
    connections are open: every route answers 503 naming the damage (a header within a
    second: `service.store.engine.HEADER_CHECK_EVERY_S`); then SIGTERM ends `trident up` and
    every process it started within the stop's grace, measured from the signal, and one line
    says why the head was stopped although the store could not say which jobs were active."""
    db = tmp_path / "trident.db"
    [job_id, *_] = fill_jobs(db, 200)
    pages = table_pages(db, "jobs")
    up = Up(tmp_path, free_port(), {"TRIDENT_LEASE_S": "3", "TRIDENT_POLL_INTERVAL_S": "0.2",
                                    "TRIDENT_STOP_GRACE_S": str(GRACE_S)})
    try:
        up.wait_healthy()
        head = live_head(tmp_path)
        assert head is not None
        started = psutil.Process(up.proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        assert "gcs_server" in names and "service.control.daemon" in names, names

        if damage == "header":
            damage_header(db)
            what = "file is not a database"
        else:
            damage_pages(db, pages)
            what = "database disk image is malformed"
        assert what in malformed(db)
        paths = ("/api/v1/jobs", f"/api/v1/jobs/{job_id}", "/", f"/jobs/{job_id}", "/metrics")

        def every_path_503() -> bool:
            return all(HTTP.get(up.server + path, headers=up.auth, timeout=30).status_code
                       == 503 for path in paths)

        wait_for("every route answering 503", every_path_503, 30)
        for path in paths:
            r = HTTP.get(up.server + path, headers=up.auth, timeout=30)
            assert r.status_code == 503, (path, r.status_code, r.text[:300])
            assert f"database is damaged (DatabaseError: {what})" in r.text, (path, r.text[:300])
            kind = ("application/json" if path.startswith("/api/") else
                    "text/plain" if path == "/metrics" else "text/html")
            assert r.headers["content-type"].startswith(kind), (path, r.headers)
        took, running = up.stop_within(GRACE_S)
    finally:
        out = up.stop()
    assert not running, (f"{took:.1f} s after SIGTERM", running, up.log())
    # A clean stop (no traceback), the head stopped although the store could not say
    # whether jobs were active, in one line that says why.
    assert up.proc.returncode == 0, out
    assert "Traceback" not in out, out
    why = [line for line in out.splitlines() if "stopping the Ray head" in line]
    assert len(why) == 1 and why[0].startswith(f"the database {db} is damaged (DatabaseError:"
                                               f" {what})"), out
    assert "no controller can re-attach its jobs without their records" in why[0], why
    assert not answers(head), f"the Ray head at {head} still answers"
    log = (tmp_path / "controller.log").read_text()
    assert "Traceback" not in log.split("signal SIGTERM")[-1], log[-3000:]
