"""A submitted spec stays inside its job: checkpoint paths inside the roots (after `..` and
symlinks), in a folder of the job's own (not the data directory nor what Trident keeps there,
not another job's folder), entrypoints under the allowed modules, no loader variables in
`env`, bodies at most 1 MiB; each refused with the stated message, nothing stored and nothing
written outside the roots. Through the API, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.files.checkpoint_dirs import RULE, CheckpointWriter, claim
from service.settings import Settings
from service.store import Store
from tests.conftest import tiny_spec, user_token


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    """(a checkpoint root, a directory outside it)."""
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    return root, outside


def make_client(store: Store, tmp_path: Path, root: Path, **settings: Any) -> TestClient:
    s = Settings(data_dir=tmp_path / "data", checkpoint_roots=str(root), **settings)
    return TestClient(create_app(s, store=store))


@pytest.fixture
def client(store: Store, tmp_path: Path, roots: tuple[Path, Path]) -> Iterator[TestClient]:
    with make_client(store, tmp_path, roots[0]) as c:
        c.headers["Authorization"] = f"Bearer {user_token(store, 'alice', 'member')}"
        yield c


def refusal(r: Any) -> tuple[list[str], str]:
    assert r.status_code == 422, r.text
    [d] = r.json()["detail"]
    return d["loc"], d["msg"]


def test_checkpoint_dir_must_resolve_inside_the_roots(client: TestClient, store: Store,
                                                      roots: tuple[Path, Path]) -> None:
    root, outside = roots
    (root / "escape").symlink_to(outside, target_is_directory=True)
    real_root = os.path.realpath(root)
    for path in [f"{root}/../outside/run", str(outside / "run"), "/etc/trident",
                 f"{root}/escape/run", f"{root}/escape"]:
        loc, msg = refusal(client.post("/api/v1/jobs", json=tiny_spec(
            checkpoint={"dir": path, "every_steps": 2})))
        assert loc == ["body", "checkpoint", "dir"]
        assert msg.startswith(f"{path!r} resolves to ") and \
            msg.endswith(f"outside the server's checkpoint roots: {real_root}"), msg
    loc, msg = refusal(client.post("/api/v1/jobs", json=tiny_spec(
        checkpoint={"dir": "runs/a"})))
    assert loc == ["body", "checkpoint", "dir"] and "is not an absolute path" in msg
    assert client.get("/api/v1/jobs").json()["total"] == 0  # nothing stored
    assert list(outside.iterdir()) == []  # nothing written outside the roots
    for path in [str(root / "a"), f"{root}/x/../b"]:
        r = client.post("/api/v1/jobs", json=tiny_spec(checkpoint={"dir": path}))
        assert r.status_code == 201, (path, r.text)
    # A root is where every job's folder is: no job's own.
    loc, msg = refusal(client.post("/api/v1/jobs", json=tiny_spec(checkpoint={"dir": str(root)})))
    assert loc == ["body", "checkpoint", "dir"] and RULE in msg
    assert msg.startswith(f"{str(root)!r} is the checkpoint root {real_root} itself"), msg


def test_default_checkpoint_root_is_the_data_directory(store: Store, tmp_path: Path) -> None:
    with TestClient(create_app(Settings(data_dir=tmp_path / "data"), store=store),
                    headers={"Authorization": f"Bearer {user_token(store)}"}) as c:
        inside = tmp_path / "data" / "checkpoints" / "j"
        assert c.post("/api/v1/jobs", json=tiny_spec(checkpoint={"dir": str(inside)})
                      ).status_code == 201
        loc, msg = refusal(c.post("/api/v1/jobs", json=tiny_spec(
            checkpoint={"dir": str(tmp_path / "elsewhere")})))
        assert msg.endswith(f"roots: {os.path.realpath(tmp_path / 'data')}")


def member(store: Store, name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {user_token(store, name, 'member')}"}


def test_a_member_may_not_name_the_data_directory_or_another_jobs_default_folder(
        store: Store, tmp_path: Path) -> None:
    """The default roots: the data directory, where Trident keeps its database, admin token,
    Ray's files (and its auth token) and the rank logs, and every job's default folder."""
    data = tmp_path / "data"
    (data / "ray").mkdir(parents=True)
    (data / "ray" / "auth_token").write_text("secret\n")
    real = os.path.realpath(data)
    with TestClient(create_app(Settings(data_dir=data), store=store)) as c:
        bob = c.post("/api/v1/jobs", json=tiny_spec(), headers=member(store, "bob"))
        assert bob.status_code == 201, bob.text
        theirs = f"{data}/checkpoints/job-{bob.json()['id']}"
        alice = member(store, "alice")
        refused = {
            str(data): f"{str(data)!r} is the data directory {real}",
            f"{data}/ray": "inside the data directory",
            f"{data}/ray/../ray/sub": "inside the data directory",
            f"{data}/logs": "inside the data directory",
            f"{data}/admin.token": "inside the data directory",
            f"{data}/checkpoints": "where every job's default folder is",
            theirs: f"the default checkpoint folder of job {bob.json()['id']}",
            f"{theirs}/sub": f"the default checkpoint folder of job {bob.json()['id']}",
            f"{data}/checkpoints/job-999": "the default checkpoint folder of job 999",
        }
        for path, why in refused.items():
            loc, msg = refusal(c.post("/api/v1/jobs", headers=alice, json=tiny_spec(
                checkpoint={"dir": path, "every_steps": 2})))
            assert loc == ["body", "checkpoint", "dir"], path
            assert why in msg and RULE in msg, (path, msg)
        assert "ray/, logs/" in c.post("/api/v1/jobs", headers=alice, json=tiny_spec(
            checkpoint={"dir": f"{data}/ray"})).json()["detail"][0]["msg"]
        assert c.get("/api/v1/jobs", headers=alice).json()["total"] == 1  # bob's alone
        assert sorted(os.listdir(data / "ray")) == ["auth_token"]  # nothing written there
        r = c.post("/api/v1/jobs", headers=alice, json=tiny_spec(
            checkpoint={"dir": f"{data}/checkpoints/alice-run"}))
        assert r.status_code == 201, r.text


def test_a_folder_recorded_as_another_jobs_is_refused(client: TestClient, store: Store,
                                                      roots: tuple[Path, Path]) -> None:
    """A named folder that a job started with (its record says which, and whose) is that job's:
    no new job may name it, or a folder inside it, not even one of the same owner; a folder
    holding checkpoints that no job recorded is refused too."""
    root, _ = roots
    bob = member(store, "bob")
    r = client.post("/api/v1/jobs", headers=bob, json=tiny_spec(
        checkpoint={"dir": str(root / "bob-run"), "every_steps": 2}))
    assert r.status_code == 201, r.text
    bob_job = r.json()["id"]
    claim(root / "bob-run", CheckpointWriter(job_id=bob_job, owner="bob"))  # as at its start
    (root / "old").mkdir()
    (root / "old" / "step4").mkdir()  # written before folders had records
    for headers in (client.headers, bob):  # alice, then bob himself
        for path, why in [(root / "bob-run", f"the checkpoints of job {bob_job} (owner bob)"),
                          (root / "bob-run" / "inner",
                           f"the checkpoint folder of job {bob_job} (owner bob)"),
                          (root / "old", "(step4) that no job is recorded as having written")]:
            loc, msg = refusal(client.post("/api/v1/jobs", headers=dict(headers), json=tiny_spec(
                checkpoint={"dir": str(path), "every_steps": 2})))
            assert loc == ["body", "checkpoint", "dir"] and why in msg and RULE in msg, msg
    assert client.get("/api/v1/jobs").json()["total"] == 1
    assert not (root / "bob-run" / "inner").exists()


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH",
                                  "PYTHONSTARTUP", "PYTHONHOME", "DYLD_INSERT_LIBRARIES",
                                  "PATH", "BASH_ENV"])
def test_loader_variables_are_refused_to_members(client: TestClient, name: str) -> None:
    loc, msg = refusal(client.post("/api/v1/jobs", json=tiny_spec(
        env={"NCCL_DEBUG": "INFO", name: "/tmp/x"})))
    assert loc == ["body", "env"]
    assert msg.startswith(f"{name} would change how the worker process itself loads")
    assert "only an admin may set them" in msg and "TRIDENT_ENV_ALLOW" in msg


def test_secrets_are_held_to_the_same_deny_list_as_env(
        client: TestClient, store: Store, tmp_path: Path, roots: tuple[Path, Path]) -> None:
    """Secrets reach the same environment as `env`: a member may not set loader variables
    through them either; an admin may, and so may a name the server allows."""
    value = "/tmp/evil-site-packages"
    r = client.post("/api/v1/jobs", json=tiny_spec(
        secrets={"PYTHONPATH": value, "LD_DEBUG": "all-of-it", "HF_TOKEN": "hf_abcdefgh"}))
    loc, msg = refusal(r)
    assert loc == ["body", "secrets"]
    assert msg.startswith("LD_DEBUG, PYTHONPATH would change how the worker process itself")
    assert "only an admin may set them" in msg and value not in r.text
    assert client.get("/api/v1/jobs").json()["total"] == 0
    admin = {"Authorization": f"Bearer {user_token(store)}"}
    assert client.post("/api/v1/jobs", json=tiny_spec(secrets={"PYTHONPATH": value}),
                       headers=admin).status_code == 201
    with make_client(store, tmp_path, roots[0], env_allow="PYTHONPATH") as c:
        c.headers["Authorization"] = client.headers["Authorization"]
        assert c.post("/api/v1/jobs", json=tiny_spec(
            secrets={"PYTHONPATH": value})).status_code == 201
        loc, msg = refusal(c.post("/api/v1/jobs", json=tiny_spec(
            secrets={"LD_PRELOAD": "/x/y/z.so"})))
        assert loc == ["body", "secrets"] and msg.startswith("LD_PRELOAD would change")


def test_ordinary_variables_pass_and_an_admin_may_allow_loader_ones(
        client: TestClient, store: Store, tmp_path: Path, roots: tuple[Path, Path]) -> None:
    ok = {"NCCL_DEBUG": "INFO", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
          "CUDA_VISIBLE_DEVICES": "0", "MY_SETTING": "1", "LD": "x", "XPYTHONPATH": "y"}
    assert client.post("/api/v1/jobs", json=tiny_spec(env=ok)).status_code == 201
    admin = {"Authorization": f"Bearer {user_token(store)}"}
    r = client.post("/api/v1/jobs", json=tiny_spec(env={"LD_PRELOAD": "/x.so"}), headers=admin)
    assert r.status_code == 201  # an admin may set them
    with make_client(store, tmp_path, roots[0], env_allow="LD_LIBRARY_PATH, PYTHONPATH") as c:
        c.headers["Authorization"] = client.headers["Authorization"]
        assert c.post("/api/v1/jobs", json=tiny_spec(
            env={"LD_LIBRARY_PATH": "/opt/lib"})).status_code == 201
        loc, msg = refusal(c.post("/api/v1/jobs", json=tiny_spec(env={"LD_PRELOAD": "/x"})))
        assert msg.startswith("LD_PRELOAD would change")


def test_entrypoint_modules_restrict_custom_code(store: Store, tmp_path: Path,
                                                 roots: tuple[Path, Path]) -> None:
    gpt = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32}
    with make_client(store, tmp_path, roots[0], entrypoint_modules="examples") as c:
        c.headers["Authorization"] = f"Bearer {user_token(store, 'alice', 'member')}"
        assert c.post("/api/v1/jobs", json=tiny_spec(
            model=gpt, entrypoint="examples.custom_entrypoint:train")).status_code == 201
        for entrypoint in ["tests.entrypoints:explode", "examplesx.mod:train", "os:system"]:
            loc, msg = refusal(c.post("/api/v1/jobs", json=tiny_spec(
                model=gpt, entrypoint=entrypoint)))
            module = entrypoint.split(":")[0]
            assert loc == ["body", "entrypoint"]
            assert msg == (f"module {module!r} is not under the modules this server allows"
                           " (TRIDENT_ENTRYPOINT_MODULES): examples")
        # Viewers run no code at all: they may not submit.
        viewer = {"Authorization": f"Bearer {user_token(store, 'vic', 'viewer')}"}
        r = c.post("/api/v1/jobs", json=tiny_spec(model=gpt,
                                                  entrypoint="examples.custom_entrypoint:train"),
                   headers=viewer)
        assert r.status_code == 403 and r.json()["detail"].startswith("jobs:submit:")


def test_a_spec_names_only_an_mlflow_server_the_server_allows(store: Store, tmp_path: Path,
                                                              roots: tuple[Path, Path]) -> None:
    """The exporter sends the server's tracker credentials: a URI of the user's choosing
    would get them, so it is refused before anything is stored."""
    with make_client(store, tmp_path, roots[0], mlflow_uri="http://mlflow.corp:5000",
                     mlflow_uris="https://mlflow.other/team/") as c:
        c.headers["Authorization"] = f"Bearer {user_token(store, 'alice', 'member')}"
        for ok in ("http://mlflow.corp:5000/", "https://mlflow.other/team", None):
            r = c.post("/api/v1/jobs", json=tiny_spec(tracking={"mlflow": ok}))
            assert r.status_code == 201, r.text
        loc, msg = refusal(c.post("/api/v1/jobs", json=tiny_spec(
            tracking={"mlflow": "http://attacker.example:80"})))
        assert loc == ["body", "tracking", "mlflow"]
        assert msg == ("http://attacker.example:80 is not among the MLflow servers this server"
                       " allows (TRIDENT_MLFLOW_URIS): http://mlflow.corp:5000,"
                       " https://mlflow.other/team")
        loc, msg = refusal(c.post("/api/v1/jobs", json=tiny_spec(
            tracking={"mlflow": "http://user:pw@mlflow.corp:5000"})))
        assert loc == ["body", "tracking", "mlflow"] and "without credentials" in msg
        jobs = c.get("/api/v1/jobs").json()["total"]
    assert jobs == 3  # nothing of the refused ones stored


def test_oversize_bodies_are_413_and_limits_are_in_the_schema(client: TestClient) -> None:
    r = client.post("/api/v1/jobs", json=tiny_spec(env={"PAD": "x" * 4000, **{
        f"V{i}": "x" * 4000 for i in range(300)}}))
    assert r.status_code == 413 and "larger than 1048576 bytes" in r.json()["detail"]
    openapi = client.get("/openapi.json").json()
    schema = openapi["components"]["schemas"]
    body = openapi["paths"]["/api/v1/jobs"]["post"]["requestBody"]["content"]
    spec = schema[body["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]]["properties"]
    assert spec["env"]["maxProperties"] == 256 and spec["env"]["propertyNames"]["pattern"]
    assert spec["env"]["additionalProperties"]["maxLength"] == 4096
    assert spec["name"]["pattern"].endswith("{0,127}$")
    assert schema["UserIn"]["properties"]["name"]["maxLength"] == 64
    r = client.post("/api/v1/jobs", json=tiny_spec(env={f"V{i}": "1" for i in range(257)}))
    assert r.status_code == 422 and "at most 256 variables" in r.text


def test_an_oversize_body_without_a_length_is_413_too(client: TestClient) -> None:
    """A chunked body declares no length: it is counted as it arrives."""
    def chunks() -> Iterator[bytes]:
        yield b'{"name": "big", "env": {"PAD": "'
        for _ in range(300):
            yield b"x" * 4096
        yield b'"}}'

    r = client.post("/api/v1/jobs", content=chunks(),
                    headers={"Content-Type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert r.status_code == 413 and "larger than 1048576 bytes" in r.json()["detail"]
    assert client.get("/api/v1/jobs").json()["total"] == 0
