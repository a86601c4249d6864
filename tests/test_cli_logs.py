"""`trident logs` and `trident events` against a live API: rank selection by list and
pipeline stage, `--tail`, `--since` and `--timestamps` (from the writer's time index),
`--grep`, prefixes, paging past one answer, and `--follow` run as a real process for a bounded
time and checked for what it printed."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from service.contract.states import JobState
from service.files.ranklogs import attempt_log_dir
from tests.cli_stack import TINY, Live, finish, spawn
from tests.conftest import user_token
from tests.servers import HTTP
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_700_000_000.0
"""When the first line was written (unix time); a line a minute after it."""


def started(live: Live) -> tuple[int, Path]:
    """A running 4-rank job (pp 2 x dp 2): rank r printed `r<r> line <i>` for i in 0..4, the
    i-th at T0 + 60 i, with the time index the writer keeps."""
    r = live.cli("submit", TINY, "-d", "--set", "parallel={tp: 1, pp: 2, dp: 2, zero: 1}",
                 "--set", "cluster.gpus_per_node=4")
    assert r.exit_code == 0, r.output
    job_id = int(r.stdout)
    live.store.transition(job_id=job_id, to=JobState.PLACING, message="placing")
    live.store.start_attempt(job_id=job_id)
    live.store.transition(job_id=job_id, to=JobState.RUNNING, message="running", attempt=1)
    d = attempt_log_dir(live.settings.log_root, job_id, 1)
    d.mkdir(parents=True)
    for rank in range(4):
        log, times, offset = d / f"rank-{rank}.log", [], 0
        for i in range(5):
            offset += len(f"r{rank} line {i}\n")
            times.append(f"{T0 + 60 * i:.3f} {offset}\n")
        log.write_text("".join(f"r{rank} line {i}\n" for i in range(5)))
        (d / f"rank-{rank}.log.times").write_text("".join(times))
        os.utime(log, (T0 + 240, T0 + 240))
    return job_id, d


def test_logs_select_ranks_stages_lines_and_times(live: Live) -> None:
    job_id, d = started(live)

    def lines(*args: str) -> list[str]:
        r = live.cli("logs", str(job_id), *args)
        assert r.exit_code == 0, (args, r.output)
        return r.stdout.splitlines()

    assert lines() == [f"[rank {r}] r{r} line {i}" for r in range(4) for i in range(5)]
    assert lines("--rank", "0,3") == [f"[rank {r}] r{r} line {i}" for r in (0, 3)
                                      for i in range(5)]
    assert lines("--rank", "3", "--rank", "1", "--tail", "1") == ["[rank 1] r1 line 4",
                                                                  "[rank 3] r3 line 4"]
    assert lines("--stage", "1", "--tail", "2") == [
        "[rank 2] r2 line 3", "[rank 2] r2 line 4", "[rank 3] r3 line 3", "[rank 3] r3 line 4"]
    assert lines("--stage", "0", "--rank", "1,2", "--no-prefix") == [
        f"r1 line {i}" for i in range(5)]
    assert lines("--grep", r"r[02] line [34]") == [
        "[rank 0] r0 line 3", "[rank 0] r0 line 4", "[rank 2] r2 line 3", "[rank 2] r2 line 4"]
    # --since: what was written at or after T0 + 150 s (lines 3 and 4), as an ISO time.
    since = datetime.fromtimestamp(T0 + 150, UTC).isoformat()
    assert lines("--rank", "0", "--since", since) == ["[rank 0] r0 line 3",
                                                      "[rank 0] r0 line 4"]
    # Over REST, a time without a zone is UTC, and unix seconds work too.
    naive = datetime.fromtimestamp(T0 + 150, UTC).replace(tzinfo=None).isoformat()
    for when in (naive, str(T0 + 150)):
        body = HTTP.get(f"{live.url}/api/v1/jobs/{job_id}/logs", params={
            "rank": 0, "since_time": when}, headers={
            "Authorization": f"Bearer {user_token(live.store)}"}).json()
        assert body["ranks"][0]["text"] == "r0 line 3\nr0 line 4\n", (when, body)
    stamped = lines("--rank", "2", "--timestamps", "--tail", "3")
    assert stamped == [f"{datetime.fromtimestamp(T0 + 60 * i, UTC).isoformat(timespec='milliseconds').replace('+00:00', 'Z')} [rank 2] r2 line {i}"  # noqa: E501
                       for i in (2, 3, 4)]
    # A relative --since: everything (the lines are older than now) or nothing.
    assert len(lines("--since", "1d")) == 0 and len(lines("--since", "100000d")) == 20
    for args, message in ((["--stage", "2"], "--stage 2: job"),
                          (["--stage", "1", "--rank", "0"], "none of them is in stage 1"),
                          (["--since", "soon"], "expected a duration"),
                          (["--grep", "("], "not a regular expression")):
        r = live.cli("logs", str(job_id), *args)
        assert r.exit_code == 2 and message in r.stderr, (args, r.output)
    # More than one answer holds (256 KiB per rank): the CLI pages through all of it.
    big = [f"big line {i:06d} " + "x" * 80 for i in range(4000)]
    (d / "rank-1.log").write_text("\n".join(big) + "\n")
    assert lines("--rank", "1", "--no-prefix") == big


def test_logs_follow_prints_new_lines_until_the_job_ends(live: Live) -> None:
    job_id, d = started(live)
    proc, out = spawn(live, "logs", str(job_id), "-f", "--rank", "1", "--tail", "2",
                      "--timestamps")
    try:
        wait_for("the last two lines", lambda: len(out) >= 2)
        with (d / "rank-1.log").open("a") as f:
            f.write("r1 new line\n")
        wait_for("the new line", lambda: any(line.endswith("r1 new line") for line in out))
        live.store.transition(job_id=job_id, to=JobState.SUCCEEDED, message="done")
        assert finish(proc, out) == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [line.split(" ", 1)[1] for line in out] == [
        "[rank 1] r1 line 3", "[rank 1] r1 line 4", "[rank 1] r1 new line"]
    # The new line is newer than the index: its time is when the file last changed (now).
    when = datetime.fromisoformat(out[-1].split(" ")[0].replace("Z", "+00:00")).timestamp()
    assert abs(when - time.time()) < 60


def test_logs_follow_reconnects_when_the_server_ends_the_stream(
        live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server ends a follow stream after FOLLOW_MAX_S (an hour; here 1 s): the CLI
    reconnects and prints every line once."""
    import api.routes.logs as route

    streams: list[int] = []
    real = route._follow

    def counted(*args: object, **kw: object) -> object:
        streams.append(1)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(route, "FOLLOW_MAX_S", 1)
    monkeypatch.setattr(route, "_follow", counted)
    job_id, d = started(live)
    proc, out = spawn(live, "logs", str(job_id), "-f", "--rank", "0,3")
    try:
        wait_for("two reconnects", lambda: len(streams) >= 3)
        with (d / "rank-3.log").open("a") as f:
            f.write("r3 after reconnecting\n")
        wait_for("the new line", lambda: any("after reconnecting" in line for line in out))
        live.store.transition(job_id=job_id, to=JobState.SUCCEEDED, message="done")
        assert finish(proc, out) == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted(out) == sorted([f"[rank {r}] r{r} line {i}" for r in (0, 3) for i in range(5)]
                                 + ["[rank 3] r3 after reconnecting"])


def test_events_print_filter_and_follow(live: Live) -> None:
    job_id, _ = started(live)
    live.store.add_event(job_id=job_id, kind="placement", message="rank 0 -> node-a",
                         attempt=1)
    r = live.cli("events", str(job_id))
    assert r.exit_code == 0, r.output
    kinds = [line.split()[1] for line in r.stdout.splitlines()]
    assert kinds[-1] == "placement" and set(kinds[:-1]) == {"state"}
    r = live.cli("events", str(job_id), "--kind", "placement")
    assert r.stdout.splitlines()[0].endswith("placement  rank 0 -> node-a")
    assert len(r.stdout.splitlines()) == 1
    proc, out = spawn(live, "events", str(job_id), "-f")
    try:
        wait_for("the events so far", lambda: len(out) >= len(kinds))
        live.store.add_event(job_id=job_id, kind="failure",
                             message="rank 1 failed:\nTraceback ...\nRuntimeError: boom")
        live.store.transition(job_id=job_id, to=JobState.FAILED, message="failed")
        assert finish(proc, out) == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "RuntimeError: boom" in out and out[-1].endswith("state      failed"), out


def test_a_log_without_a_time_index(live: Live) -> None:
    """Logs written before the time index existed: --timestamps gives the file's time."""
    job_id, d = started(live)
    (d / "rank-0.log.times").unlink()
    r = live.cli("logs", str(job_id), "--rank", "0", "--tail", "1", "--timestamps")
    assert r.exit_code == 0, r.output
    stamp = datetime.fromtimestamp(T0 + 240, UTC).isoformat(timespec="milliseconds")
    assert r.stdout.splitlines() == [f"{stamp.replace('+00:00', 'Z')} [rank 0] r0 line 4"]


def test_a_reconnected_stream_prints_only_what_was_not_printed() -> None:
    from dataclasses import replace

    from client.rest import unseen
    from service.files.ranklogs import Chunk

    printed = {1: 13}
    chunk = Chunk(rank=1, text="ab\ncd\nef", next=18, skipped=0, size=18,
                  times=[1.0, 2.0, 3.0])
    assert unseen(chunk, printed) == replace(chunk, text="cd\nef", times=[2.0, 3.0])
    assert printed == {1: 18}
    assert unseen(chunk, printed).text == ""  # all of it seen
    other = replace(chunk, rank=2)
    assert unseen(other, printed) is other and printed[2] == 18
