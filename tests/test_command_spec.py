"""A `command:` job's spec through the API in-process: what it may not carry beside
`command`, where its `workdir` may be (inside the server's code roots, after `..` and
symlinks), who may give one (admins; members where the server allows it), the environment
rules of `env` and `secrets` as for every job; and the environment its process gets
(`workers.runtime.command_env`: torchrun's variables and Trident's)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.contract.spec import JobSpec
from service.settings import Settings
from service.store import Store
from tests.conftest import tiny_spec, user_token
from workers.runtime.command_env import NodePlace, command_env


@pytest.fixture
def code(tmp_path: Path) -> tuple[Path, Path]:
    """(a code root with a `train/` folder, a folder outside it)."""
    root, outside = tmp_path / "code", tmp_path / "outside"
    (root / "train").mkdir(parents=True)
    outside.mkdir()
    return root, outside


def client_of(store: Store, tmp_path: Path, who: str, **settings: Any) -> TestClient:
    c = TestClient(create_app(Settings(data_dir=tmp_path / "data", **settings), store=store))
    role = "admin" if who == "admin" else "member"
    c.headers["Authorization"] = f"Bearer {user_token(store, who, role)}"
    return c


@pytest.fixture
def admin(store: Store, tmp_path: Path, code: tuple[Path, Path]) -> Iterator[TestClient]:
    with client_of(store, tmp_path, "admin", code_roots=str(code[0])) as c:
        yield c


def command_spec(workdir: str | Path, **over: object) -> dict[str, object]:
    return tiny_spec(command=[sys.executable, "train.py"], workdir=str(workdir), **over)


def refusal(r: Any) -> tuple[list[str], str]:
    assert r.status_code == 422, r.text
    [d] = r.json()["detail"]
    return d["loc"], d["msg"]


def test_an_admins_command_in_a_code_root_is_queued(admin: TestClient,
                                                    code: tuple[Path, Path]) -> None:
    r = admin.post("/api/v1/jobs", json=command_spec(
        code[0] / "train", progress={"preset": "torchtitan"}))
    assert r.status_code == 201, r.text
    spec = r.json()["spec"]
    assert spec["command"] == [sys.executable, "train.py"]
    assert spec["progress"]["preset"] == "torchtitan"


@pytest.mark.parametrize(("over", "field", "words"), [
    ({"entrypoint": "examples.custom_entrypoint:train"}, "entrypoint", "instead of"),
    ({"program": "light"}, "program", "instead of"),
    ({"faults": [{"kind": "fail", "rank": 0, "step": 1}]}, "faults", "fails by itself"),
    ({"workdir": None}, "workdir", "needs the folder"),
])
def test_what_a_command_may_not_carry_is_named(admin: TestClient, code: tuple[Path, Path],
                                               over: dict[str, object], field: str,
                                               words: str) -> None:
    spec = {**command_spec(code[0]), **over}
    loc, msg = refusal(admin.post("/api/v1/jobs", json=spec))
    assert loc == ["body", field] and words in msg, (loc, msg)


@pytest.mark.parametrize("field", ["workdir", "progress"])
def test_workdir_and_progress_are_for_command_jobs_only(admin: TestClient, field: str) -> None:
    value = "/tmp" if field == "workdir" else {"regex": r"step (?P<step>\d+)"}
    loc, msg = refusal(admin.post("/api/v1/jobs", json=tiny_spec(**{field: value})))
    assert loc == ["body", field] and "for a command job" in msg


def test_workdir_must_resolve_to_a_folder_inside_the_code_roots(
        admin: TestClient, code: tuple[Path, Path]) -> None:
    root, outside = code
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (root / "train.py").write_text("print('hello')\n")
    for path, words in [(outside, "outside the server's code roots"),
                        (f"{root}/../outside", "outside the server's code roots"),
                        (root / "escape", "outside the server's code roots"),
                        ("/etc", "outside the server's code roots"),
                        ("train", "not an absolute path"),
                        (root / "train.py", "not a folder"),
                        (root / "missing", "not a folder")]:
        loc, msg = refusal(admin.post("/api/v1/jobs", json=command_spec(path)))
        assert loc == ["body", "workdir"] and words in msg, (path, msg)
        assert "TRIDENT_CODE_ROOTS" in msg or words != "outside the server's code roots"
    assert admin.get("/api/v1/jobs").json()["items"] == []


def test_a_server_without_code_roots_runs_no_command(store: Store, tmp_path: Path,
                                                     code: tuple[Path, Path]) -> None:
    with client_of(store, tmp_path, "admin") as c:
        loc, msg = refusal(c.post("/api/v1/jobs", json=command_spec(code[0])))
    assert loc == ["body", "command"] and "TRIDENT_CODE_ROOTS" in msg


def test_members_run_commands_only_where_the_server_allows_them(
        store: Store, tmp_path: Path, code: tuple[Path, Path]) -> None:
    with client_of(store, tmp_path, "bob", code_roots=str(code[0])) as c:
        loc, msg = refusal(c.post("/api/v1/jobs", json=command_spec(code[0])))
        assert loc == ["body", "command"] and "TRIDENT_ALLOW_MEMBER_COMMANDS" in msg
        assert c.post("/api/v1/jobs", json=tiny_spec()).status_code == 201  # the rest runs
    with client_of(store, tmp_path, "bob", code_roots=str(code[0]),
                   allow_member_commands=True) as c:
        assert c.post("/api/v1/jobs", json=command_spec(code[0])).status_code == 201
        # The environment rules of every job hold for a command's too.
        loc, msg = refusal(c.post("/api/v1/jobs", json=command_spec(
            code[0], env={"LD_PRELOAD": "/tmp/x.so"})))
        assert loc == ["body", "env"] and "LD_PRELOAD" in msg
        loc, msg = refusal(c.post("/api/v1/jobs", json=command_spec(
            code[0], secrets={"PYTHONPATH": "/tmp"})))
        assert loc == ["body", "secrets"] and "PYTHONPATH" in msg


def test_a_commands_arguments_are_bounded_printable_text(admin: TestClient,
                                                         code: tuple[Path, Path]) -> None:
    for command, words in [([], "at least 1"), (["x"] * 257, "at most 256"),
                           (["a\nb"], "control character"), ([""], "at least 1 character")]:
        r = admin.post("/api/v1/jobs", json={**command_spec(code[0]), "command": command})
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"][:2] == ["body", "command"], r.text
        assert words in r.text, r.text


def test_the_process_gets_torchruns_environment_and_tridents() -> None:
    spec = JobSpec.model_validate(command_spec("/srv/code", env={"NCCL_DEBUG": "INFO"}))
    base = {"PATH": "/usr/bin", "NCCL_DEBUG": "INFO", "RANK": "99", "HF_TOKEN": "secret",
            "CUDA_VISIBLE_DEVICES": ""}
    node = NodePlace.of(3, ["a", "a", "b", "b"])
    assert node == NodePlace(local_world_size=2, group_rank=1, group_world_size=2)
    env = command_env(base, spec, rank=3, world_size=4, local_rank=1, node=node,
                      master_addr="10.0.0.1", master_port=29500, job_id=7, attempt=2,
                      checkpoint_dir="/ckpt/job-7", resume_step=40,
                      report_path="/logs/rank-3.report.jsonl")
    assert {k: env[k] for k in (
        "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
        "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID", "TRIDENT_JOB_ID", "TRIDENT_CHECKPOINT_DIR",
        "TRIDENT_RESUME_STEP", "TRIDENT_REPORT")} == {
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "3", "WORLD_SIZE": "4",
        "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_RUN_ID": "trident-job7", "TRIDENT_JOB_ID": "7",
        "TRIDENT_CHECKPOINT_DIR": "/ckpt/job-7", "TRIDENT_RESUME_STEP": "40",
        "TRIDENT_REPORT": "/logs/rank-3.report.jsonl"}
    # The actor's environment (the job's env and secrets, the device defaults) passes on.
    assert env["NCCL_DEBUG"] == "INFO" and env["HF_TOKEN"] == "secret"
    assert env["PATH"] == "/usr/bin" and env["CUDA_VISIBLE_DEVICES"] == ""
    fresh = command_env(base, spec, rank=0, world_size=1, local_rank=0,
                        node=NodePlace.of(0, ["a"]), master_addr="h", master_port=1,
                        job_id=7, attempt=1, checkpoint_dir=None, resume_step=0,
                        report_path="r", gpu_ids=["2", "5"])
    assert "TRIDENT_RESUME_STEP" not in fresh and "TRIDENT_CHECKPOINT_DIR" not in fresh
    assert fresh["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert fresh["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert os.environ.get("RANK") != "99"  # nothing of it leaked into this process


def test_the_ddp_example_spec_is_valid() -> None:
    import yaml

    spec = JobSpec.model_validate(yaml.safe_load(
        (Path(__file__).resolve().parent.parent / "examples" / "command" / "ddp.yaml")
        .read_text()))
    assert spec.command is not None and spec.command[1] == "ddp_train.py"
    assert spec.progress is not None and spec.world_size == 2
    line = "step 12 loss 0.031250"
    found = spec.progress.pattern().search(line)
    assert found is not None and found["step"] == "12"
