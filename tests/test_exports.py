"""Exports' places and routes (issue 44, point 3), in this process: where an export's folder
may be (`service.files.export.ExportPlaces`: under an export root, in the job owner's folder,
symlinks resolved, `..` refused, never over another folder's files), what
`POST /jobs/{id}/exports` refuses (each 4xx naming its field), what it records and lists, who
may call each route, and the file routes' confinement to the export's folder. The exports
written and downloaded are tests/test_hf_models.py's (a process of its own) and
tests/test_e2e_exports.py's (a Ray task)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.files.checkpoint_tags import MARKER
from service.files.export import ExportPlaces, file_path, listing, shard_bytes
from service.settings import Settings
from service.store import Store
from service.store.exports import ExportRecords
from tests.conftest import tiny_spec, user_token


def test_a_destination_lies_in_the_owners_folder_under_an_export_root(tmp_path: Path) -> None:
    roots = [tmp_path / "a", tmp_path / "b"]
    for r in roots:
        (r / "alice").mkdir(parents=True)
    places = ExportPlaces(roots, tmp_path / "data")
    assert places.refusal(str(tmp_path / "b" / "alice" / "m"), "alice") is None
    assert places.refusal(str(tmp_path / "a" / "alice" / "deep" / "m"), "alice") is None
    cases = {
        "relative/m": "not an absolute path",
        str(tmp_path / "elsewhere" / "m"): "outside the job owner's folders",
        str(tmp_path / "a" / "bob" / "m"): "outside the job owner's folders",
        str(tmp_path / "a" / "alice"): "outside the job owner's folders",  # the folder itself
        str(tmp_path / "a" / "alice" / ".." / "bob" / "m"): "has a '..' part",
        str(tmp_path / "a" / "alice" / "x" / ".." / "m"): "has a '..' part",
        str(tmp_path / "a" / "alice" / "m\0"): "has a NUL character",
    }
    for raw, why in cases.items():
        got = places.refusal(raw, "alice")
        assert got is not None and why in got, (raw, got)
    # a symlink in alice's folder that leads out of it: its real path is what counts
    (tmp_path / "a" / "alice" / "out").symlink_to(tmp_path / "elsewhere")
    got = places.refusal(str(tmp_path / "a" / "alice" / "out" / "m"), "alice")
    assert got is not None and f"resolves to {tmp_path}/elsewhere/m" in got, got
    # never over files: a folder that holds some, or a file
    (tmp_path / "a" / "alice" / "full").mkdir()
    (tmp_path / "a" / "alice" / "full" / "x").write_text("")
    (tmp_path / "a" / "alice" / "empty").mkdir()
    got = places.refusal(str(tmp_path / "a" / "alice" / "full"), "alice")
    assert got is not None and "exists already" in got, got
    assert places.refusal(str(tmp_path / "a" / "alice" / "empty"), "alice") is None
    assert places.refusal(str(tmp_path / "a" / "x"), "../x") is not None  # no owner folder
    # the default: the first root's owner folder, a new name when it is taken
    assert places.default("alice", 7, 30) == f"{tmp_path}/a/alice/job-7-step30"
    (tmp_path / "a" / "alice" / "job-7-step30").mkdir()
    assert places.default("alice", 7, 30) == f"{tmp_path}/a/alice/job-7-step30-2"


def test_shard_sizes_read_as_transformers_reads_them() -> None:
    assert [shard_bytes(t) for t in ("5GB", "500MB", "5GiB", "1024", "1.5 gb")] == [
        5 * 10**9, 5 * 10**8, 5 * 2**30, 1024, 15 * 10**8]
    for bad in ("5XB", "0", "2TiB", "-1GB", "GB"):
        with pytest.raises(ValueError):
            shard_bytes(bad)


def test_the_data_directory_is_no_destination_but_its_exports_folder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    places = ExportPlaces([data / "exports", data], data)
    assert places.refusal(str(data / "exports" / "alice" / "m"), "alice") is None
    got = places.refusal(str(data / "alice" / "m"), "alice")
    assert got is not None and "inside the data directory" in got, got


def test_the_file_routes_serve_only_the_export_folders_own_files(tmp_path: Path) -> None:
    folder = tmp_path / "job-1-step3"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / ".hidden").write_text("")
    (tmp_path / "secret").write_text("s")
    (folder / "link.json").symlink_to(tmp_path / "secret")
    assert listing(str(folder)) == [("config.json", 2)]
    assert file_path(str(folder), "config.json") == f"{folder}/config.json"
    for name in ("../secret", "link.json", ".hidden", "missing.json", "a/b"):
        assert file_path(str(folder), name) is None, name


def _app(tmp_path: Path, store: Store) -> TestClient:
    settings = Settings(data_dir=tmp_path / "data", checkpoint_roots=str(tmp_path),
                        export_roots=f"{tmp_path / 'exports'},{tmp_path / 'more'}")
    return TestClient(create_app(settings, store=store))


def test_the_export_route_refuses_naming_the_field_and_records_what_it_takes(
        tmp_path: Path, sqlite_store: Store) -> None:
    with _app(tmp_path, sqlite_store) as c:
        alice = {"Authorization": f"Bearer {user_token(sqlite_store, 'alice', 'member')}"}
        bob = {"Authorization": f"Bearer {user_token(sqlite_store, 'bob', 'member')}"}
        admin = {"Authorization": f"Bearer {user_token(sqlite_store)}"}
        r = c.post("/api/v1/jobs", json=tiny_spec(checkpoint={"dir": str(tmp_path / "job")}),
                   headers=alice)
        assert r.status_code == 201, r.text
        job = r.json()["id"]
        url = f"/api/v1/jobs/{job}/exports"
        r = c.post(url, json={}, headers=alice)
        assert r.status_code == 404 and "no complete checkpoint tag yet" in r.text, r.text
        for step in (4, 8):
            (tmp_path / "job" / f"step{step}").mkdir(parents=True)
            (tmp_path / "job" / f"step{step}" / MARKER).write_text(f"{step}\n")
        assert c.post(url, json={"step": 6}, headers=alice).status_code == 404
        for bad in ("5XB", "0", "2TiB", "GB"):
            r = c.post(url, json={"max_shard_size": bad}, headers=alice)
            assert r.status_code == 422, (bad, r.text)
            assert r.json()["detail"][0]["loc"] == ["body", "max_shard_size"], r.text
        for dest in (str(tmp_path / "job" / "out"), str(tmp_path / "exports" / "bob" / "x"),
                     f"{tmp_path}/exports/alice/../bob/x", "exports/alice/x"):
            r = c.post(url, json={"destination": dest}, headers=alice)
            assert r.status_code == 422, (dest, r.text)
            detail = r.json()["detail"][0]
            assert detail["loc"] == ["body", "destination"], r.text
            assert detail["msg"].startswith("destination: "), r.text
        r = c.post(url, json={"step": 99, "nothing": 1}, headers=alice)
        assert r.status_code == 422  # an unknown field, and the step's bounds
        # bob may not export alice's weights, nor see her exports
        assert c.post(url, json={}, headers=bob).status_code == 403
        assert c.get(url, headers=bob).status_code == 403
        # the newest tag, to the owner's default folder under the first root
        r = c.post(url, json={"max_shard_size": "10KB"}, headers=alice)
        assert r.status_code == 202, r.text
        first = r.json()
        assert first["state"] == "pending" and first["step"] == 8
        assert first["destination"] == f"{tmp_path}/exports/alice/job-{job}-step8"
        assert first["max_shard_bytes"] == 10_000 and first["requested_by"] == "alice"
        # an admin's, of step 4, where alice's folder is under the second root
        dest = str(tmp_path / "more" / "alice" / "v4")
        r = c.post(url, json={"step": 4, "destination": dest}, headers=admin)
        assert r.status_code == 202 and r.json()["destination"] == dest, r.text
        listed = c.get(url, headers=alice).json()["items"]
        assert [(e["step"], e["destination"]) for e in listed] == [
            (4, dest), (8, first["destination"])]
        assert c.get(f"{url}/{first['id']}", headers=alice).json() == first
        assert c.get(f"{url}/{first['id']}", headers=bob).status_code == 403
        assert c.get(f"{url}/999", headers=alice).status_code == 404
        # nothing served until the export is done; then only what it wrote, in its folder
        r = c.get(f"{url}/{first['id']}/files", headers=alice)
        assert r.status_code == 409 and "pending" in r.text, r.text
        folder = Path(first["destination"])
        folder.mkdir(parents=True)
        (folder / "config.json").write_text('{"a": 1}')
        (folder / "extra.json").write_text("{}")
        ExportRecords(sqlite_store).finish(first["id"], files=["config.json"], size=8)
        r = c.get(f"{url}/{first['id']}/files", headers=alice)
        assert r.json()["items"] == [{"name": "config.json", "bytes": 8}], r.text
        r = c.get(f"{url}/{first['id']}/files/config.json", headers=alice)
        assert r.status_code == 200 and r.content == b'{"a": 1}', r.text
        for name in ("extra.json", "..%2F..%2Fjob%2Fstep8%2F" + MARKER):
            assert c.get(f"{url}/{first['id']}/files/{name}", headers=alice).status_code in (
                404, 422), name
        assert c.get(f"{url}/{first['id']}/files/config.json",
                     headers=bob).status_code == 403



def test_the_runner_keeps_to_its_limit_and_fails_what_a_stopped_controller_left(
        tmp_path: Path, sqlite_store: Store) -> None:
    """The controller's bookkeeping (`service.control.export_run`), its task a function of the
    test's that waits until released: at most `limit` run at once, the rest wait pending; an
    export a previous controller took (`running`, no task here) is failed with the reason; a
    task's refusal and a task's exception are recorded as the export's error."""
    from threading import Event

    from service.control.export_run import ExportRunner
    from service.files.export import ExportDone, ExportWork

    with _app(tmp_path, sqlite_store) as c:
        c.headers["Authorization"] = f"Bearer {user_token(sqlite_store, 'alice', 'member')}"
        r = c.post("/api/v1/jobs", json=tiny_spec(checkpoint={"dir": str(tmp_path / "job")}))
        job_id = r.json()["id"]
    records = ExportRecords(sqlite_store)
    made = [records.create(job_id=job_id, step=1, destination=str(tmp_path / f"e{i}"),
                           checkpoint_dir=str(tmp_path), max_shard_bytes=1 << 20,
                           requested_by="alice") for i in range(4)]
    records.take(made[0].id)  # a previous controller's, never finished
    release = Event()
    seen: list[ExportWork] = []

    def run(work: ExportWork) -> ExportDone:
        seen.append(work)
        release.wait(30)
        if work.export_id == made[1].id:
            raise OSError("disk full")
        return ExportDone(refused="no such tag")

    runner = ExportRunner(sqlite_store, run, limit=2)
    runner.step()
    states = {e.id: e for e in records.of_job(job_id)}
    assert states[made[0].id].state == "failed"
    assert "stopped before it ended" in (states[made[0].id].error or "")
    assert [states[m.id].state for m in made[1:]] == ["running", "running", "pending"]
    release.set()
    runner.drain(30)
    runner.step()
    runner.drain(30)
    ended = {e.id: e for e in records.of_job(job_id)}
    assert [ended[m.id].state for m in made] == ["failed"] * 4
    assert ended[made[1].id].error == "OSError: disk full"
    assert ended[made[2].id].error == ended[made[3].id].error == "no such tag"
    assert {w.export_id for w in seen} == {m.id for m in made[1:]}
    assert seen[0].shape["vocab"] > 0 and seen[0].node_id is None
    runner.shutdown()
