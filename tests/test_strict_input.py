"""Input checked at the door: bounded integers in paths and queries, strict numbers in bodies,
printable environments, resources some node can offer, a body size cap, and idempotent
submission under keys of the caller's own; on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.body_limit import MAX_BODY_BYTES
from service.contract.spec import JobSpec
from service.settings import Settings
from service.store import Store
from service.submission.intake import KeyReused, Submitter, submit_once
from tests.conftest import authed_client, tiny_spec, user_token

TOO_BIG = [2**31, 2**63, 2**64]


@pytest.fixture
def client(store: Store, tmp_path: Path) -> Iterator[TestClient]:
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as c:
        yield c


def _loc(r: object) -> list[list[str]]:
    return [d["loc"] for d in r.json()["detail"]]  # type: ignore[attr-defined]


@pytest.mark.parametrize("big", TOO_BIG)
def test_integers_in_paths_and_queries_above_the_column_range_are_422(
        client: TestClient, big: int) -> None:
    job_id = client.post("/api/v1/jobs", json=tiny_spec()).json()["id"]
    cases = [
        ("GET", f"/api/v1/jobs/{big}", {}, ["path", "job_id"]),
        ("POST", f"/api/v1/jobs/{big}/cancel", {}, ["path", "job_id"]),
        ("GET", f"/api/v1/jobs/{big}/events", {}, ["path", "job_id"]),
        ("GET", f"/api/v1/jobs/{big}/metrics", {}, ["path", "job_id"]),
        ("GET", f"/api/v1/jobs/{big}/attempts", {}, ["path", "job_id"]),
        ("GET", f"/api/v1/jobs/{big}/comm", {}, ["path", "job_id"]),
        ("GET", f"/api/v1/probes/{big}", {}, ["path", "probe_id"]),
        ("GET", "/api/v1/jobs", {"offset": big}, ["query", "offset"]),
        ("GET", f"/api/v1/jobs/{job_id}/metrics", {"rank": big}, ["query", "rank"]),
        ("GET", f"/api/v1/jobs/{job_id}/metrics", {"attempt": big}, ["query", "attempt"]),
        ("GET", f"/api/v1/jobs/{job_id}/metrics", {"after_step": big}, ["query", "after_step"]),
    ]
    if big > 2**63 - 1:  # event ids are BIGINT
        cases.append(("GET", f"/api/v1/jobs/{job_id}/events", {"after": big}, ["query", "after"]))
    for method, path, params, loc in cases:
        r = client.request(method, path, params=params)
        assert r.status_code == 422, (path, params, r.text)
        assert _loc(r) == [loc], (path, params, r.text)
    # The largest value in range is an ordinary question with an ordinary answer.
    assert client.get(f"/api/v1/jobs/{2**31 - 1}").status_code == 404
    assert client.get("/api/v1/jobs", params={"offset": 2**31 - 1}).json()["items"] == []
    r = client.get(f"/api/v1/jobs/{job_id}/events", params={"after": 2**63 - 1})
    assert r.status_code == 200 and r.json()["items"] == []
    r = client.get(f"/api/v1/jobs/{job_id}/metrics",
                   params={"rank": 2**31 - 1, "attempt": 2**31 - 1, "after_step": 2**31 - 1})
    assert r.status_code == 200 and r.json()["items"] == []


@pytest.mark.parametrize(
    ("over", "loc"),
    [
        ({"train": {"steps": True}}, ["body", "train", "steps"]),
        ({"train": {"steps": "40"}}, ["body", "train", "steps"]),
        ({"train": {"steps": 40.0}}, ["body", "train", "steps"]),
        ({"train": {"lr": "0.1"}}, ["body", "train", "lr"]),
        ({"train": {"lr": True}}, ["body", "train", "lr"]),
        ({"parallel": {"dp": 2, "zero": True}}, ["body", "parallel", "ParallelSpec", "zero"]),
        ({"parallel": {"dp": "2"}}, ["body", "parallel", "ParallelSpec", "dp"]),
        ({"resources": {"cpus_per_worker": "1"}}, ["body", "resources", "cpus_per_worker"]),
        ({"monitor": {"probe": "yes"}}, ["body", "monitor", "probe"]),
        ({"priority": False}, ["body", "priority"]),
        ({"model": {"preset": "gpt-tiny", "layers": True}}, ["body", "model", "layers"]),
    ],
)
def test_booleans_and_strings_are_not_numbers(client: TestClient, over: dict,
                                              loc: list[str]) -> None:
    r = client.post("/api/v1/jobs", json=tiny_spec(**over))
    assert r.status_code == 422, r.text
    # `parallel` is a union (a layout or "auto"): pydantic names the member it tried.
    assert loc in _loc(r), r.text
    assert client.get("/api/v1/jobs").json()["total"] == 0


def test_an_integer_is_a_valid_float(client: TestClient) -> None:
    spec = tiny_spec(train={"steps": 3, "global_batch": 8, "micro_batch": 2, "lr": 1},
                     resources={"cpus_per_worker": 1})
    r = client.post("/api/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["train"]["lr"] == 1.0


def test_probe_requests_are_strict_too(client: TestClient) -> None:
    for body, field in (({"ranks_per_node": "2"}, "ranks_per_node"),
                        ({"ranks_per_node": True}, "ranks_per_node"),
                        ({"max_bytes": 1.5e6}, "max_bytes")):
        r = client.post("/api/v1/probes", json=body)
        assert r.status_code == 422 and _loc(r) == [["body", field]], r.text


def test_calibration_requests_name_their_field(client: TestClient) -> None:
    """`POST /calibrations` (`trident probe --calibrate`): strict, 3-8 job ids; on a cluster
    whose profile no probe calibrated, a 404 saying to probe first."""
    for body, field in (({"jobs": [1, 2]}, "jobs"), ({"jobs": list(range(1, 10))}, "jobs"),
                        ({"jobs": ["1", 2, 3]}, "jobs"), ({"jobs": [0, 2, 3]}, "jobs"),
                        ({"jobs": [1, 2, 3], "profile": 5}, "profile"),
                        ({"jobs": [1, 2, 3], "profile": "tpu"}, "profile"),
                        ({"jobs": [1, 2, 3], "extra": 1}, "extra"), ({}, "jobs")):
        r = client.post("/api/v1/calibrations", json=body)
        assert r.status_code == 422 and [loc[:2] for loc in _loc(r)] == [["body", field]], \
            (body, r.text)
    r = client.post("/api/v1/calibrations", json={"jobs": [1, 2, 3], "profile": "h100-80gb"})
    assert r.status_code == 404 and "trident probe --profile h100-80gb" in r.json()["detail"]


@pytest.mark.parametrize("value", ["a\x00b", "line\nbreak", "tab\there", "bell\x07", "del\x7f"])
def test_control_characters_in_env_values_are_refused(client: TestClient, value: str) -> None:
    r = client.post("/api/v1/jobs", json=tiny_spec(env={"NCCL_DEBUG": value}))
    assert r.status_code == 422, r.text
    [d] = r.json()["detail"]
    assert d["loc"] == ["body", "env"] and "NCCL_DEBUG" in d["msg"] and "control" in d["msg"]
    r = client.post("/api/v1/jobs", json=tiny_spec(env={"A\x00": "x"}))
    assert r.status_code == 422 and _loc(r) == [["body", "env"]]
    ok = client.post("/api/v1/jobs", json=tiny_spec(env={"NCCL_DEBUG": "INFO x=1 ü"}))
    assert ok.status_code == 201, ok.text


def test_what_ray_or_the_os_would_refuse_is_a_422_naming_its_field(client: TestClient,
                                                                    tmp_path: Path) -> None:
    """Refused at submission, against the field, not at start: resource quantities Ray
    cannot claim (it counts in units of 0.0001, and refuses less than one when it creates the
    ranks, after the placement group), and paths or environment values the OS refuses."""
    ckpt = f"{tmp_path}/checkpoints"
    cpus, path = ["body", "resources", "cpus_per_worker"], ["body", "checkpoint", "dir"]
    cases = [
        ({"resources": {"cpus_per_worker": 1e-9}}, cpus, "1e-09 is not a whole number of"
         " Ray's resource units (0.0001)"),
        ({"resources": {"cpus_per_worker": 0.00015}}, cpus, "use a multiple of 0.0001"),
        ({"checkpoint": {"dir": f"{ckpt}/a\x00b"}}, path, "holds a NUL byte"),
        ({"checkpoint": {"dir": f"{ckpt}/a\nb"}}, path, "holds a control character"),
        ({"checkpoint": {"dir": f"{ckpt}/{'x' * 256}/a"}}, path,
         "is 256 bytes long in UTF-8; the OS takes at most 255 per component"),
        ({"checkpoint": {"dir": f"{ckpt}/" + "é/" * 1400}}, path,
         f"is {len(ckpt) + 1 + 3 * 1400} bytes long in UTF-8; the OS takes at most 4095"),
        ({"checkpoint": {"dir": "/" + "a" * 4095}}, path, "at most 4095 characters"),
        ({"checkpoint": {"dir": f"{ckpt}/\ud800"}}, path, "unable to parse raw data as a unicode"),
        ({"env": {"NCCL_DEBUG": "\ud800"}}, ["body", "env", "NCCL_DEBUG"],
         "unable to parse raw data as a unicode"),
    ]
    for over, loc, msg in cases:
        # A lone surrogate, escaped in the JSON as any client library sends it.
        r = client.post("/api/v1/jobs", content=json.dumps(tiny_spec(**over)),
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 422, (over, r.text)
        [d] = r.json()["detail"]
        assert d["loc"] == loc and msg in d["msg"], (over, d)
    assert client.get("/api/v1/jobs").json()["total"] == 0
    for fine in (0.0001, 0.3, 1.25):
        r = client.post("/api/v1/jobs", json=tiny_spec(resources={"cpus_per_worker": fine}))
        assert r.status_code == 201, r.text
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    assert schema["ResourcesSpec"]["properties"]["cpus_per_worker"]["multipleOf"] == 0.0001


def test_more_ranks_than_one_node_need_a_cluster(client: TestClient) -> None:
    wide = tiny_spec(parallel={"dp": 128}, train={"global_batch": 128, "micro_batch": 1})
    for path in ("/api/v1/plan", "/api/v1/jobs"):
        r = client.post(path, json=wide)
        assert r.status_code == 422, r.text
        [d] = r.json()["detail"]
        assert d["loc"] == ["body", "cluster"] and "128 ranks need a cluster" in d["msg"]
    planned = client.post("/api/v1/plan", json={
        **wide, "cluster": {"gpu": "cpu", "nodes": 2, "gpus_per_node": 64}})
    assert planned.status_code == 200, planned.text
    assert planned.json()["world_size"] == 128


def _nodes(store: Store, *resources: dict[str, float]) -> None:
    store.upsert_nodes(nodes=[{"node_id": f"n{i}", "hostname": f"h{i}", "resources": r}
                              for i, r in enumerate(resources)])


def test_resources_no_node_offers_are_refused_at_submit(client: TestClient,
                                                        store: Store) -> None:
    # Nothing recorded yet: accepted, the scheduler decides when nodes are known.
    assert client.post("/api/v1/jobs", json=tiny_spec(
        resources={"cpus_per_worker": 1024})).status_code == 201
    _nodes(store, {"CPU": 16.0, "memory": 1e10}, {"CPU": 8.0, "GPU": 2.0})
    cases = [
        ({"cpus_per_worker": 1024}, {}, ["body", "resources", "cpus_per_worker"],
         "claims 1024 CPUs"),
        ({"cpus_per_worker": 1, "gpus_per_worker": 4}, {},
         ["body", "resources", "gpus_per_worker"], "claims 1 CPUs and 4 GPUs"),
        # tp 2: one bundle of 2 x 10 CPUs, more than any single node.
        ({"cpus_per_worker": 10}, {"parallel": {"tp": 2, "dp": 1}},
         ["body", "resources", "cpus_per_worker"], "tp(2) ranks claims 20 CPUs"),
        # Each bundle fits some node, the two together fit nowhere.
        ({"cpus_per_worker": 12}, {}, ["body", "resources"], "fit nowhere together"),
    ]
    for resources, over, loc, msg in cases:
        spec = tiny_spec(resources=resources, **over)
        r = client.post("/api/v1/jobs", json=spec)
        assert r.status_code == 422, r.text
        [d] = r.json()["detail"]
        assert d["loc"] == loc and msg in d["msg"], d
        assert "16 CPUs" in d["msg"] or "8 CPUs / 2 GPUs" in d["msg"], d  # the largest node
    assert client.get("/api/v1/jobs").json()["total"] == 1
    assert client.post("/api/v1/jobs", json=tiny_spec(
        resources={"cpus_per_worker": 8})).status_code == 201
    # Dead nodes offer nothing; nodes recorded without resources are not counted.
    store.upsert_nodes(nodes=[{"node_id": "x", "hostname": "x", "accelerator": "cpu"}])
    assert client.post("/api/v1/jobs", json=tiny_spec(
        resources={"cpus_per_worker": 1024})).status_code == 201


def test_bodies_over_the_cap_are_413_before_parsing(client: TestClient) -> None:
    huge = b'{"name": "' + b"x" * MAX_BODY_BYTES + b'"}'
    r = client.post("/api/v1/jobs", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "1 MiB" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"name": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 1):
            yield b"x" * 65536

    r = client.post("/api/v1/plan", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "1 MiB" in r.json()["detail"]
    # Just under the cap is read and judged on its content.
    near = b'{"name": "' + b"x" * (MAX_BODY_BYTES - 20) + b'"}'
    assert len(near) <= MAX_BODY_BYTES
    r = client.post("/api/v1/jobs", content=near, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert str(MAX_BODY_BYTES) in client.get("/openapi.json").json()["info"]["description"]


def test_the_worst_layout_search_is_a_bounded_422(client: TestClient) -> None:
    many = tiny_spec(model={"layers": 720, "hidden": 720, "heads": 720, "vocab": 256,
                            "seq_len": 32},
                     train={"global_batch": 720720, "micro_batch": 1}, parallel="auto",
                     cluster={"gpu": "a100-80gb", "nodes": 630, "gpus_per_node": 8})
    for path in ("/api/v1/plan", "/api/v1/jobs"):
        r = client.post(path, json=many)
        assert r.status_code == 422, r.text[:300]
        [d] = r.json()["detail"]
        assert d["loc"] == ["body", "parallel"] and "candidates" in d["msg"], d


def test_a_retried_submission_returns_the_first_job(client: TestClient) -> None:
    key = {"Idempotency-Key": "retry-7f3a"}
    first = client.post("/api/v1/jobs", json=tiny_spec(), headers=key)
    again = client.post("/api/v1/jobs", json=tiny_spec(), headers=key)
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert client.get("/api/v1/jobs").json()["total"] == 1
    # Same spec, other key (or none): a new job.
    assert client.post("/api/v1/jobs", json=tiny_spec(),
                       headers={"Idempotency-Key": "other"}).status_code == 201
    assert client.post("/api/v1/jobs", json=tiny_spec()).status_code == 201
    # Same key, another spec: a conflict that says so; nothing created.
    r = client.post("/api/v1/jobs", json=tiny_spec(name="renamed"), headers=key)
    assert r.status_code == 409
    [d] = r.json()["detail"]
    assert d["loc"] == ["header", "idempotency-key"]
    assert f"job {first.json()['id']}" in d["msg"] and "another spec" in d["msg"]
    assert client.get("/api/v1/jobs").json()["total"] == 3


@pytest.mark.parametrize("key", ["", "a b", "x" * 256, "é"])
def test_idempotency_keys_are_short_printable_text(client: TestClient, key: str) -> None:
    r = client.post("/api/v1/jobs", json=tiny_spec(),
                    headers=[("Idempotency-Key", key.encode("utf-8"))])
    assert r.status_code == 422, r.text
    assert _loc(r) == [["header", "idempotency-key"]]
    assert client.get("/api/v1/jobs").json()["total"] == 0


def test_an_idempotency_key_is_the_callers_own(store: Store, tmp_path: Path) -> None:
    """Another user's key with the same spec makes a job of the caller's own; each user's
    retry still finds their first job, and a conflict names only the caller's job."""
    alice = {"Authorization": f"Bearer {user_token(store, 'alice', 'member')}",
             "Idempotency-Key": "shared-7f3a"}
    bob = {"Authorization": f"Bearer {user_token(store, 'bob', 'member')}",
           "Idempotency-Key": "shared-7f3a"}
    with TestClient(create_app(Settings(data_dir=tmp_path), store=store)) as c:
        hers = c.post("/api/v1/jobs", json=tiny_spec(), headers=alice)
        assert hers.status_code == 201 and hers.json()["owner"] == "alice", hers.text
        his = c.post("/api/v1/jobs", json=tiny_spec(), headers=bob)
        assert his.status_code == 201, his.text
        assert his.json()["owner"] == "bob" and his.json()["id"] != hers.json()["id"]
        for who, first in ((alice, hers), (bob, his)):
            again = c.post("/api/v1/jobs", json=tiny_spec(), headers=who)
            assert again.status_code == 200, again.text
            assert (again.json()["id"], again.json()["owner"]) == (first.json()["id"],
                                                                   first.json()["owner"])
        r = c.post("/api/v1/jobs", json=tiny_spec(name="renamed"), headers=bob)
        assert r.status_code == 409
        [d] = r.json()["detail"]
        assert f"job {his.json()['id']} " in d["msg"]
        assert f"job {hers.json()['id']} " not in d["msg"]
        listed = c.get("/api/v1/jobs", headers={"Authorization": alice["Authorization"]})
        assert sorted((j["id"], j["owner"]) for j in listed.json()["items"]) == [
            (hers.json()["id"], "alice"), (his.json()["id"], "bob")]


def test_concurrent_retries_create_one_job_per_owner(store: Store) -> None:
    """Three retries each of two users, all at once, under one key: one job per user."""
    spec = JobSpec.model_validate(tiny_spec())
    results: list[tuple[str, int, bool]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def retry(owner: str) -> None:
        start.wait()
        try:
            job, created = submit_once(store, spec, "same-key", Submitter(owner=owner))
            results.append((job.owner, job.id, created))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=retry, args=(owner,)) for owner in ["alice", "bob"] * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for owner in ("alice", "bob"):
        mine = [(job_id, created) for who, job_id, created in results if who == owner]
        assert len({job_id for job_id, _ in mine}) == 1, results
        assert sorted(created for _, created in mine) == [False, False, True], results
    assert len({job_id for _, job_id, _ in results}) == 2
    assert store.list_jobs()[1] == 2
    with pytest.raises(KeyReused):
        submit_once(store, JobSpec.model_validate(tiny_spec(name="other")), "same-key",
                    Submitter(owner="alice"))


def test_every_integer_in_a_path_or_query_is_bounded(client: TestClient) -> None:
    """Every route, read from the API's own schema: an integer parameter has a minimum and a
    maximum within a BIGINT column, so that no value reaches the database unchecked (a route
    added without bounds fails here)."""
    checked = []
    for path, ops in client.get("/openapi.json").json()["paths"].items():
        for method, op in ops.items():
            for p in op.get("parameters", []):
                for schema in p["schema"].get("anyOf", [p["schema"]]):
                    if schema.get("type") != "integer":
                        continue
                    where = f"{method.upper()} {path} {p['in']} {p['name']}"
                    assert schema.get("minimum") is not None, where
                    assert schema.get("maximum") is not None, where
                    assert schema["maximum"] <= 2**63 - 1, where
                    checked.append(where)
    assert "GET /api/v1/jobs/{job_id} path job_id" in checked and len(checked) >= 30, checked
