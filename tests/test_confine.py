"""A submitted spec stays inside its job: checkpoint paths inside the roots (after `..` and
symlinks), entrypoints under the allowed modules, no loader variables in `env`, bodies at most
1 MiB; each refused with the stated message, nothing stored and nothing written outside the
roots. Through the API, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
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
    for path in [str(root / "a"), f"{root}/x/../b", str(root)]:
        r = client.post("/api/v1/jobs", json=tiny_spec(checkpoint={"dir": path}))
        assert r.status_code == 201, (path, r.text)


def test_default_checkpoint_root_is_the_data_directory(store: Store, tmp_path: Path) -> None:
    with TestClient(create_app(Settings(data_dir=tmp_path / "data"), store=store),
                    headers={"Authorization": f"Bearer {user_token(store)}"}) as c:
        inside = tmp_path / "data" / "checkpoints" / "j"
        assert c.post("/api/v1/jobs", json=tiny_spec(checkpoint={"dir": str(inside)})
                      ).status_code == 201
        loc, msg = refusal(c.post("/api/v1/jobs", json=tiny_spec(
            checkpoint={"dir": str(tmp_path / "elsewhere")})))
        assert msg.endswith(f"roots: {os.path.realpath(tmp_path / 'data')}")


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH",
                                  "PYTHONSTARTUP", "PYTHONHOME", "DYLD_INSERT_LIBRARIES",
                                  "PATH", "BASH_ENV"])
def test_loader_variables_are_refused_to_members(client: TestClient, name: str) -> None:
    loc, msg = refusal(client.post("/api/v1/jobs", json=tiny_spec(
        env={"NCCL_DEBUG": "INFO", name: "/tmp/x"})))
    assert loc == ["body", "env"]
    assert msg.startswith(f"{name} would change how the worker process itself loads")
    assert "only an admin may set them" in msg and "TRIDENT_ENV_ALLOW" in msg


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


def test_oversize_bodies_are_413_and_limits_are_in_the_schema(client: TestClient) -> None:
    r = client.post("/api/v1/jobs", json=tiny_spec(env={"PAD": "x" * 4000, **{
        f"V{i}": "x" * 4000 for i in range(300)}}))
    assert r.status_code == 413 and "larger than 1048576 bytes" in r.json()["detail"]
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    spec = schema["JobSpec"]["properties"]
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
