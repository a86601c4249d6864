"""Rank logs: a real process's fds 1 and 2 captured to a file under the cap, read back by
offset across rotations, served by `GET /jobs/{id}/logs` (plain and followed) and printed by
`trident logs`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.files.ranklogs import attempt_log_dir, read_chunk
from service.settings import Settings
from service.store import Store
from service.submission.intake import submit
from tests.conftest import authed_client, migrated_sqlite, tiny_spec, user_token
from tests.smallfs import small_fs
from tests.waiting import drive, wait_for
from workers.runtime.ranklog import secret_names_env

ROOT = Path(__file__).resolve().parent.parent


def run_rank(log_dir: Path, body: str, max_bytes: int = 1 << 20,
             check_s: float | None = None, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess:
    """A child process that captures its output as rank 1, then runs `body`; with `check_s`,
    its watcher looks that often (the body may call `log.look()` itself); `env`: more of its
    environment (a job's secrets, as the launcher gives them)."""
    code = textwrap.dedent(f"""
        import os, sys
        import workers.runtime.ranklog
        if {check_s!r} is not None:
            workers.runtime.ranklog.CHECK_S = {check_s!r}
        log = workers.runtime.ranklog.capture({str(log_dir)!r}, 1, {max_bytes})
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(ROOT), **(env or {})})


def test_prints_os_writes_and_tracebacks_reach_the_file(tmp_path: Path) -> None:
    out = run_rank(tmp_path, """
        print("hello from print")
        os.write(1, b"raw fd 1\\n")
        os.write(2, b"raw fd 2\\n")
        os.system("echo from a child process")
        raise RuntimeError("boom on purpose")
    """)
    assert out.returncode == 1
    assert out.stdout == "" and out.stderr == ""  # all of it went to the file
    text = (tmp_path / "rank-1.log").read_text()
    for line in ("hello from print", "raw fd 1", "raw fd 2", "from a child process",
                 "Traceback (most recent call last)", "RuntimeError: boom on purpose"):
        assert line in text
    c = read_chunk(tmp_path, 1, 0, 1 << 20)
    assert c.text == text and c.next == c.size == len(text.encode()) and c.skipped == 0


SECRET = "tr1dent-rank-log-" + "Qw7sZp3K"
"""A job's secret as its rank's environment holds it; grepped for in what the log holds."""
SECRET_ENV = {"TOKEN": SECRET, "SHORT": "abc", **secret_names_env(["TOKEN", "SHORT"])}
"""The rank's environment as the launcher makes it for a job with two secrets (`SHORT` is
below `REDACT_MIN_CHARS`: never searched for)."""


def test_a_secrets_value_is_redacted_from_every_stream_of_the_rank(app_store) -> None:
    """Whatever writes it (print, stderr, a raw fd, a child process, two writes that cut it,
    a library's exception), the rank log holds `[secret TOKEN]`, not the value, and so do the
    log route's answers to a viewer. The rest of the output is as written, bytes that are not
    UTF-8 included."""
    client, store, settings = app_store
    job_id, d = started_job(store, settings)
    out = run_rank(d, """
        import time
        v = os.environ["TOKEN"]
        print("token=" + v)
        print("on stderr: " + v, file=sys.stderr)
        os.write(1, ("fd 1 " + v + "\\n").encode())
        os.system('echo "a child: $TOKEN"')
        sys.stdout.write("cut " + v[:7])
        time.sleep(0.3)  # the rest comes later: the pump has read the first part alone
        sys.stdout.write(v[7:] + " across two writes; short secret abc; ünïcode\\n")
        os.write(2, b"raw \\xff\\xfe bytes\\n")
        raise ConnectionError("Unable to find address for: " + v)
    """, env=SECRET_ENV)
    assert out.returncode == 1 and out.stdout == "" and out.stderr == ""
    data = (d / "rank-1.log").read_bytes()
    assert SECRET.encode() not in data and SECRET[:12].encode() not in data
    text = data.decode("utf-8", "replace")
    for line in ("token=[secret TOKEN]", "on stderr: [secret TOKEN]", "fd 1 [secret TOKEN]",
                 "a child: [secret TOKEN]",
                 "cut [secret TOKEN] across two writes; short secret abc; ünïcode",
                 "ConnectionError: Unable to find address for: [secret TOKEN]"):
        assert line + "\n" in text, (line, text)
    assert b"raw \xff\xfe bytes\n" in data
    viewer = {"Authorization": f"Bearer {user_token(store, 'vic', 'viewer')}"}
    with client:
        r = client.get(f"/api/v1/jobs/{job_id}/logs", params={"rank": 1}, headers=viewer)
        assert r.status_code == 200, r.text
        assert "Unable to find address for: [secret TOKEN]" in r.text and SECRET not in r.text


@pytest.mark.slow
def test_a_secret_a_rank_prints_on_ray_is_redacted_in_its_served_log(
        ray_ns: str, tmp_path: Path) -> None:
    """A real job on Ray (two light ranks, the controller's launcher) whose entrypoint prints its
    secret to stdout and stderr and fails with it in a library's words: the rank logs on
    disk and as the log route serves them to a viewer hold `[secret NAME]`, as the job's
    error does."""
    from service.control.controller import Controller
    from service.secrets import SecretBox
    from workers.launch.launcher import RayLauncher

    settings = Settings(data_dir=tmp_path, entrypoint_modules="tests.entrypoints",
                        light_ranks=True)
    store = Store(migrated_sqlite(tmp_path / "ray.db"))
    controller = Controller(store, RayLauncher(log_root=settings.log_root,
                                               log_max_bytes=settings.rank_log_max_bytes,
                                               light_ranks=True, namespace=ray_ns),
                            checkpoint_root=settings.checkpoint_root, start_timeout_s=120,
                            box=SecretBox.of(None, tmp_path))
    member = {"Authorization": f"Bearer {user_token(store, 'alice', 'member')}"}
    viewer = {"Authorization": f"Bearer {user_token(store, 'vic', 'viewer')}"}
    try:
        with TestClient(create_app(settings, store=store)) as client:
            r = client.post("/api/v1/jobs", headers=member, json=tiny_spec(
                name="leaky", entrypoint="tests.entrypoints:leaky", monitor={"probe": False},
                program="light",
                secrets={"TRIDENT_TEST_SECRET": SECRET}))
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            assert drive(controller, store, job_id, {JobState.FAILED, JobState.SUCCEEDED},
                         240) == JobState.FAILED
            error = store.get_job(job_id=job_id).error or ""
            assert "[secret TRIDENT_TEST_SECRET]" in error and SECRET not in error

            def served() -> str:
                r = client.get(f"/api/v1/jobs/{job_id}/logs", headers=viewer,
                               params={"rank": [0, 1]})
                assert r.status_code == 200, r.text
                return "".join(c["text"] for c in r.json()["ranks"])

            said = [f"leaky rank {rank} {stream}" for rank in (0, 1)
                    for stream in ("stdout: connecting with", "stderr: retrying")]
            wait_for("both ranks' lines and tracebacks served", lambda: all(
                f"{line} [secret TRIDENT_TEST_SECRET]" in served() for line in said)
                and served().count("ConnectionError: Unable to find address for: [secret"
                                   " TRIDENT_TEST_SECRET]") == 2, 60, served)
            assert SECRET not in served()
    finally:
        controller.shutdown(stop_jobs=True)
        store.close()
    logs = [p for p in settings.log_root.rglob("*") if p.is_file()]
    assert any(p.name == "rank-1.log" for p in logs)
    assert not [p for p in logs if SECRET.encode() in p.read_bytes()]


def test_a_redacted_log_keeps_its_cap_and_offsets(tmp_path: Path) -> None:
    """Through the pump, rotation moves its writes to the new file as it moves fds 1 and 2."""
    out = run_rank(tmp_path, """
        import time
        for i in range(30):
            print(f"line {i:02d} ".ljust(39, "."))
        deadline = time.monotonic() + 30
        while log.path.stat().st_size < 1200 and time.monotonic() < deadline:
            time.sleep(0.01)  # the pump writes it
        assert log.rotate_if_full()
        print("after " + os.environ["TOKEN"])
    """, max_bytes=2000, check_s=3600, env=SECRET_ENV)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "rank-1.log.1").stat().st_size == 1200
    c = read_chunk(tmp_path, 1, 0, 1 << 20)
    assert c.skipped == 0 and c.size == c.next == 1200 + len("after [secret TOKEN]\n")
    assert c.text == "".join(f"line {i:02d} ".ljust(39, ".") + "\n" for i in range(30)) + (
        "after [secret TOKEN]\n")


def test_the_cap_keeps_the_newest_output_and_offsets_survive_rotations(tmp_path: Path) -> None:
    # Cap 2000 bytes: rotation past 1000. Three blocks of 30 lines of 40 bytes (1200 each).
    out = run_rank(tmp_path, """
        for block in range(3):
            for i in range(30):
                print(f"block {block} line {i:02d} ".ljust(39, "."))
            assert log.rotate_if_full()
        print("the end")
    """, max_bytes=2000)
    assert out.returncode == 0, out.stderr
    total = 3 * 1200 + len("the end\n")
    # Kept: the last full block (.log.1) and the current file; the first two blocks rotated.
    c = read_chunk(tmp_path, 1, 0, 1 << 20)
    assert c.size == total and c.skipped == 2400 and c.next == total
    assert c.text.startswith("block 2 line 00") and c.text.endswith("the end\n")
    assert (tmp_path / "rank-1.log").stat().st_size + (
        tmp_path / "rank-1.log.1").stat().st_size <= 2000
    # A follower that had read up to the middle of block 2 continues exactly there.
    mid = 2400 + 15 * 40
    c2 = read_chunk(tmp_path, 1, mid, 1 << 20)
    assert c2.skipped == 0 and c2.text.startswith("block 2 line 15")
    # A small read stops after a whole line; the next one continues with the next line.
    c3 = read_chunk(tmp_path, 1, mid, 100)
    assert c3.text == "block 2 line 15 ".ljust(39, ".") + "\n" + (
        "block 2 line 16 ".ljust(39, ".") + "\n")
    assert read_chunk(tmp_path, 1, c3.next, 40).text.startswith("block 2 line 17")


def test_a_full_disk_costs_the_lines_it_refuses_and_the_cap_still_holds(tmp_path: Path) -> None:
    """On a tmpfs of its own, filled while the rank writes: prints do not raise (the rank
    would end), the watcher rotates at the cap all the same and writes the base it owes once
    the disk takes writes again, and the log says there what was lost; past the full disk
    the cap holds and the stream's offsets are whole. The body looks for the watcher
    (`log.look()`) at the moments the test needs, instead of every `CHECK_S`."""
    snapshot = tmp_path / "log-after-the-full-disk.txt"
    with small_fs(tmp_path / "fs", 1) as fs:
        logs = fs / "logs"
        out = run_rank(logs, f"""
            from service.files.diskfull import TolerantStream
            from tests.smallfs import Filler

            for i in range(60):
                print(f"before {{i:02d}}".ljust(39, "."))  # 2400 bytes: past half the cap
            filler = Filler({str(fs / "filler")!r}).start()
            assert log.look()  # rotates: the renames work, the new base is refused
            assert (log.path.parent / "rank-1.log.1").stat().st_size == 2400
            assert log.base == 2400 and log.refused.count >= 1
            assert (log.path.parent / "rank-1.log.base").read_text() == "0"  # owed
            for i in range(100):
                print(f"refused {{i:02d}}".ljust(39, "."))  # nothing raises
            assert isinstance(sys.stdout, TolerantStream) and sys.stdout.refused.count > 0
            filler.free()
            assert log.look()  # the owed base, and the watcher's notice in the log
            assert (log.path.parent / "rank-1.log.base").read_text() == "2400"
            print("after the disk was freed")
            with open({str(snapshot)!r}, "w") as f:
                f.write(log.path.read_text())
            for block in range(3):  # well past the cap (4000) again
                for i in range(60):
                    print(f"block {{block}} line {{i:02d}}".ljust(39, "."))
                assert log.look()
        """, max_bytes=4000, check_s=3600)
        assert out.returncode == 0, out.stdout + out.stderr
        kept = [p for p in logs.glob("rank-1.log*") if ".base" not in p.name]
        assert sum(p.stat().st_size for p in kept) <= 4000 + 40 + 2 * 20
        c = read_chunk(logs, 1, 0, 1 << 20)
        assert c.next == c.size and c.skipped == c.size - len(c.text.encode())
        # Each block past half the cap rotated: the newest one is kept, whole.
        assert c.text == "".join(f"block 2 line {i:02d}".ljust(39, ".") + "\n"
                                 for i in range(60))
    # What the new file held once the disk took writes again: the watcher's notice, the
    # stream's (the 100 lines it refused), then the line printed after.
    notice = r"\[trident\] the disk refused writes here \(No space left on device\): "
    assert re.fullmatch(
        notice + r"\d+ log index writes? before this line could not be written\n"
        + notice + r"(\d+) bytes before this line could not be written\n"
        + "after the disk was freed\n", snapshot.read_text()), snapshot.read_text()


@pytest.fixture
def app_store(tmp_path: Path) -> tuple[TestClient, Store, Settings]:
    store = Store(migrated_sqlite(tmp_path / "logs.db"))
    settings = Settings(data_dir=tmp_path)
    return authed_client(create_app(settings, store=store), store), store, settings


def started_job(store: Store, settings: Settings) -> tuple[int, Path]:
    """A two-rank job in its first attempt with a log line from each rank."""
    job = submit(store, JobSpec.model_validate(tiny_spec()))
    store.transition(job_id=job.id, to=JobState.PLACING, message="placing")
    store.start_attempt(job_id=job.id)
    d = attempt_log_dir(settings.log_root, job.id, 1)
    d.mkdir(parents=True)
    (d / "rank-0.log").write_text("step 1 rank 0\n")
    (d / "rank-1.log").write_text("step 1 rank 1\npartial")
    return job.id, d


def test_logs_route_reads_every_rank_and_from_an_offset(app_store) -> None:
    client, store, settings = app_store
    with client:
        job_id, d = started_job(store, settings)
        r = client.get(f"/api/v1/jobs/{job_id}/logs")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["attempt"] == 1 and body["max_bytes_per_rank"] == 16 << 20
        assert [(c["rank"], c["text"]) for c in body["ranks"]] == [
            (0, "step 1 rank 0\n"), (1, "step 1 rank 1\npartial")]
        nxt = body["ranks"][1]["next"]
        with (d / "rank-1.log").open("a") as f:
            f.write(" line\nstep 2 rank 1\n")
        r = client.get(f"/api/v1/jobs/{job_id}/logs", params={"rank": 1, "since": nxt})
        assert r.json()["ranks"][0]["text"] == " line\nstep 2 rank 1\n"
        for params, field in [({"rank": 2}, "rank"), ({"rank": -1}, "rank"),
                              ({"attempt": 2}, "attempt"), ({"since": -1}, "since"),
                              ({"max_bytes": 0}, "max_bytes"),
                              ({"max_bytes": (1 << 20) + 1}, "max_bytes")]:
            r = client.get(f"/api/v1/jobs/{job_id}/logs", params=params)
            assert r.status_code == 422, (params, r.text)
            assert r.json()["detail"][0]["loc"][:2] == ["query", field]
        assert client.get("/api/v1/jobs/999/logs").status_code == 404


def test_follow_streams_new_lines_until_the_job_ends(app_store) -> None:
    client, store, settings = app_store
    with client:
        job_id, d = started_job(store, settings)
        store.transition(job_id=job_id, to=JobState.RUNNING, message="running")
        with client.stream("GET", f"/api/v1/jobs/{job_id}/logs",
                           params={"follow": True, "rank": 0}) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            lines = resp.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert json.loads(first[6:])["text"] == "step 1 rank 0\n"
            with (d / "rank-0.log").open("a") as f:
                f.write("step 2 rank 0\n")
            second = next(ln for ln in lines if ln.startswith("data: "))
            assert json.loads(second[6:])["text"] == "step 2 rank 0\n"
            store.transition(job_id=job_id, to=JobState.SUCCEEDED, message="done")
            rest = list(lines)
            assert "event: end" in rest


def test_cli_logs_prefixes_ranks_and_events_prints_events(app_store, tmp_path: Path,
                                                          monkeypatch) -> None:

    from typer.testing import CliRunner

    from cli.main import app
    from tests.servers import serving

    _, store, settings = app_store
    job_id, _ = started_job(store, settings)
    monkeypatch.setenv("TRIDENT_TOKEN", user_token(store))
    with serving(create_app(settings, store=store)) as url:
        r = CliRunner().invoke(app, ["logs", str(job_id), "--server", url])
        assert r.exit_code == 0, r.output
        assert r.output.splitlines() == ["[rank 0] step 1 rank 0", "[rank 1] step 1 rank 1",
                                         "[rank 1] partial"]
        r = CliRunner().invoke(app, ["logs", str(job_id), "--rank", "1", "--server", url])
        assert "[rank 0]" not in r.output and "[rank 1] partial" in r.output
        r = CliRunner().invoke(app, ["events", str(job_id), "--server", url])
        assert "placing" in r.output
        # Following an ended job prints everything and returns.
        for to in (JobState.RUNNING, JobState.SUCCEEDED):
            store.transition(job_id=job_id, to=to, message=to.value)
        r = CliRunner().invoke(app, ["logs", str(job_id), "-f", "--server", url])
        assert r.exit_code == 0, r.output
        assert r.output.splitlines() == ["[rank 0] step 1 rank 0", "[rank 1] step 1 rank 1",
                                         "[rank 1] partial"]


def test_the_time_index_dates_each_line_and_rotates_with_the_log(tmp_path: Path) -> None:
    """The writer records `<time> <offset>` as the stream grows; readers date each line by the
    first record at or past its end, and find where output since a time starts. The index
    rotates with the log and counts toward its cap."""
    from service.files.ranklogs import offset_at, tail_offset, time_index, with_times

    out = run_rank(tmp_path, """
        import time
        for i in range(3):
            print(f"line {i}")
            log.record_time()
            time.sleep(0.05)
        log.record_time()  # nothing new: no record
        print("unindexed")
    """)
    assert out.returncode == 0, out.stderr
    index = time_index(tmp_path, 1)
    assert [o for _, o in index] == [7, 14, 21]
    assert index[0][0] < index[1][0] < index[2][0]
    c = with_times(tmp_path, read_chunk(tmp_path, 1, 0, 1 << 20))
    mtime = (tmp_path / "rank-1.log").stat().st_mtime
    assert c.times == [index[0][0], index[1][0], index[2][0], mtime]
    assert offset_at(tmp_path, 1, index[1][0] - 0.001) == 7  # lines 1, 2 and after
    assert offset_at(tmp_path, 1, 0) == 0 and offset_at(tmp_path, 1, mtime + 1) == c.size
    assert tail_offset(tmp_path, 1, 2, 1 << 20) == 14
    assert tail_offset(tmp_path, 1, 99, 1 << 20) == 0
    # A window of 12 bytes starts inside `line 2`: the tail starts at its first whole line.
    assert read_chunk(tmp_path, 1, tail_offset(tmp_path, 1, 3, 12), 100).text == "unindexed\n"

    rotating = tmp_path / "rot"
    out = run_rank(rotating, """
        for block in range(3):
            for i in range(20):
                print(f"block {block} line {i:02d}".ljust(39, "."))
                log.record_time()
            assert log.rotate_if_full()
    """, max_bytes=2000)
    assert out.returncode == 0, out.stderr
    assert (rotating / "rank-1.log.times.1").exists()
    kept = sum(p.stat().st_size for p in rotating.glob("rank-1.log*") if ".base" not in p.name)
    assert kept <= 2000 + 40 + 20  # the cap, overshot by at most one line and one record
    c = with_times(rotating, read_chunk(rotating, 1, 0, 1 << 20))
    assert c.skipped and all(t > 0 for t in c.times or [])
    assert len(c.times or []) == len(c.text.splitlines())
