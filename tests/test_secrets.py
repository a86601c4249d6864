"""Secrets stay secret, without Ray (the ranks' side is tests/test_tracking_e2e.py): a job's
`secrets` are write-only, sealed at rest, shown by name only, carried by its owner's
resubmission; a job's `env` values are its owner's and admins' to read; the server's own
tracker credentials stay out of every process that runs jobs."""

from __future__ import annotations

import json
import os
import stat
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from api.app import create_app
from service.cluster.rayhead import RayHead
from service.contract.spec import JobSpec
from service.control import daemon
from service.redaction import redact
from service.secrets import (
    KEY_FILE,
    SERVER_SECRETS,
    SecretBox,
    SecretsUnreadable,
    without_server_secrets,
)
from service.settings import Settings
from service.store import Store
from service.store.identity import Identity
from tests.conftest import tiny_spec

VALUE = "hunter2-but-a-much-longer-api-key-0987"
ENV_VALUE = "wandb-project-of-alice"


def test_a_secret_is_sealed_and_only_its_key_opens_it(tmp_path: Path) -> None:
    box = SecretBox.of(None, tmp_path / "data")
    assert not (tmp_path / "data" / KEY_FILE).exists()  # made when first needed
    sealed = box.seal(VALUE)
    key_file = tmp_path / "data" / KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert VALUE.encode() not in sealed and box.open(sealed) == VALUE
    assert SecretBox.of(None, tmp_path / "data").open(sealed) == VALUE  # the same key file
    other = SecretBox.of(SecretBox.new_key().decode(), tmp_path)
    with pytest.raises(SecretsUnreadable, match="another key") as err:
        other.open(sealed, "secret API_KEY")
    assert VALUE not in str(err.value)
    with pytest.raises(ValueError, match="not a Fernet key") as bad:
        SecretBox.of("not-a-key-" + VALUE, tmp_path)
    assert VALUE not in str(bad.value)


def test_redact_replaces_every_secret_value_by_its_name() -> None:
    text_ = f"RuntimeError: token {VALUE} refused; short one: abc"
    assert redact(text_, {"API_KEY": VALUE, "PIN": "abc"}) == \
        "RuntimeError: token [secret API_KEY] refused; short one: abc"


def test_secrets_are_write_only_in_the_spec() -> None:
    spec = JobSpec.model_validate(tiny_spec(secrets={"API_KEY": VALUE}))
    assert spec.secret_values() == {"API_KEY": VALUE}
    assert "secrets" not in spec.model_dump() and VALUE not in spec.model_dump_json()
    assert VALUE not in repr(spec) and VALUE not in str(spec)
    schema = JobSpec.model_json_schema()["properties"]["secrets"]
    assert schema["writeOnly"] is True and schema["maxProperties"] == 64
    for bad, why in [({"1X": "v"}, "not a valid environment variable name"),
                     ({"K": "a\nb"}, "control character"),
                     ({f"K{i}": "v" for i in range(65)}, "at most 64")]:
        with pytest.raises(ValueError, match=why):
            JobSpec.model_validate(tiny_spec(secrets=bad))
    with pytest.raises(ValueError, match="set in env too"):
        JobSpec.model_validate(tiny_spec(secrets={"K": "v"}, env={"K": "w"}))


@pytest.fixture
def api(store: Store, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, dict[str, str]]]]:
    identity = Identity(store)
    for p in ("vision", "speech"):
        identity.create_project(name=p)
    heads = {}
    for name, role, project in [("admin", "admin", "vision"), ("alice", "member", "vision"),
                                ("bob", "member", "vision"), ("carol", "member", "speech"),
                                ("victor", "viewer", "vision")]:
        identity.create_user(name=name, role=role, projects=[project])
        heads[name] = {"Authorization":
                       f"Bearer {identity.create_token(user=name, name='t')[0]}"}
    with TestClient(create_app(Settings(data_dir=tmp_path), store=store)) as client:
        yield client, heads


def test_env_values_are_the_owners_and_admins_secrets_names_are_everyones(
        api: tuple[TestClient, dict[str, dict[str, str]]], store: Store) -> None:
    client, heads = api
    r = client.post("/api/v1/jobs", headers=heads["alice"],
                    json=tiny_spec(env={"WANDB_PROJECT": ENV_VALUE},
                                   secrets={"API_KEY": VALUE}))
    assert r.status_code == 201 and VALUE not in r.text and r.json()["secrets"] == ["API_KEY"]
    job_id = r.json()["id"]
    other = client.post("/api/v1/jobs", headers=heads["bob"], json=tiny_spec(name="b")).json()
    for who, reads in [("alice", True), ("admin", True), ("bob", False), ("carol", False),
                       ("victor", False)]:
        h = heads[who]
        answers = {
            "job": client.get(f"/api/v1/jobs/{job_id}", headers=h),
            "list": client.get("/api/v1/jobs?owner=alice", headers=h),
            "compare": client.get(f"/api/v1/compare?jobs={job_id}&jobs={other['id']}",
                                  headers=h),
            "page": client.get(f"/jobs/{job_id}", headers=h),
            "plan page": client.get(f"/plan?job={job_id}", headers=h),
        }
        for what, a in answers.items():
            assert a.status_code == 200, (who, what, a.text)
            assert VALUE not in a.text, (who, what)
            assert (ENV_VALUE in a.text) == reads, (who, what)
        job = answers["job"].json()
        assert job["secrets"] == ["API_KEY"]
        assert job["env_hidden"] == ([] if reads else ["WANDB_PROJECT"])
        assert job["spec"]["env"] == ({"WANDB_PROJECT": ENV_VALUE} if reads else {})
        diff = {d["field"]: d["values"] for d in answers["compare"].json()["differences"]}
        assert diff["env.WANDB_PROJECT"] == [ENV_VALUE if reads else "(hidden)", None]
        assert "API_KEY" in answers["page"].text  # by name
    # At rest: in a table of its own, sealed; not in the spec, not in the audit log.
    with store.engine.connect() as c:
        spec = c.execute(text("SELECT spec FROM jobs WHERE id = :i"), {"i": job_id}).scalar()
        sealed = c.execute(text("SELECT sealed FROM job_secrets WHERE job_id = :i"),
                           {"i": job_id}).scalar()
    assert VALUE not in str(spec) and "API_KEY" not in str(spec)
    assert VALUE.encode() not in bytes(sealed)
    audit = client.get("/api/v1/audit?limit=1000", headers=heads["admin"])
    assert audit.status_code == 200 and VALUE not in audit.text
    assert "POST" in audit.text


def test_the_owners_resubmission_carries_the_secrets_an_admins_does_not(
        api: tuple[TestClient, dict[str, dict[str, str]]], store: Store, tmp_path: Path
) -> None:
    client, heads = api
    job_id = client.post("/api/v1/jobs", headers=heads["alice"],
                         json=tiny_spec(secrets={"API_KEY": VALUE})).json()["id"]
    box = SecretBox.of(None, tmp_path)
    mine = client.post(f"/api/v1/jobs/{job_id}/resubmit", headers=heads["alice"])
    assert mine.status_code == 201 and VALUE not in mine.text
    assert box.open_all(store.job_secrets(job_id=mine.json()["id"])) == {"API_KEY": VALUE}
    theirs = client.post(f"/api/v1/jobs/{job_id}/resubmit", headers=heads["admin"])
    assert theirs.status_code == 201 and theirs.json()["owner"] == "admin"
    assert store.job_secrets(job_id=theirs.json()["id"]) == {} and theirs.json()["secrets"] == []


def test_a_secret_refused_at_submission_is_not_echoed(
        api: tuple[TestClient, dict[str, dict[str, str]]]) -> None:
    client, heads = api
    for secrets in ({"K": "x" * 16385 + VALUE}, {"K": VALUE + "\n"}):
        r = client.post("/api/v1/jobs", headers=heads["alice"], json=tiny_spec(secrets=secrets))
        assert r.status_code == 422 and VALUE not in r.text, r.text
        assert "secrets" in r.text


def test_the_servers_tracker_credentials_stay_out_of_processes_that_run_jobs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SERVER_SECRETS:
        monkeypatch.setenv(name, f"server-{name}")
    assert without_server_secrets(os.environ).keys().isdisjoint(SERVER_SECRETS)
    # `trident up`'s Ray head (whose workers run every job's ranks).
    head = RayHead(tmp_path)
    assert not set(head.supervisor.env) & set(SERVER_SECRETS)
    assert head.supervisor.env["RAY_AUTH_MODE"] == "token"
    # The daemon's own Ray (run alone): the environment Ray starts with has none of them.
    seen: dict[str, Any] = {}

    def fake_import(name: str) -> Any:
        if name == "ray":
            return types.SimpleNamespace(init=lambda **kw: seen.update(env=dict(os.environ)))
        if name == "workers.launch.group":
            return types.SimpleNamespace(NAMESPACE="trident")
        return types.SimpleNamespace(RayLauncher=lambda **kw: "launcher")

    monkeypatch.setattr(daemon.importlib, "import_module", fake_import)
    settings = Settings(data_dir=tmp_path)
    assert settings.mlflow_token is not None  # read before they go
    saved = dict(os.environ)
    try:
        daemon.connect_ray(settings)
    finally:  # it sets Ray's loopback variables in this process too: not for other tests
        os.environ.clear()
        os.environ.update(saved)
    assert seen and not set(seen["env"]) & set(SERVER_SECRETS)
    assert settings.mlflow_token.get_secret_value() == "server-TRIDENT_MLFLOW_TOKEN"


def test_the_controller_gives_the_ranks_their_secrets_and_stores_none_from_them(
        sqlite_store: Store, tmp_path: Path) -> None:
    from service.cluster.data_plane import PollResult
    from service.contract.states import JobState
    from service.control.controller import Controller
    from service.submission.intake import Submitter, submit
    from tests.fakes import FakeLauncher

    box = SecretBox.of(None, tmp_path)
    spec = JobSpec.model_validate(tiny_spec(secrets={"API_KEY": VALUE}))
    job = submit(sqlite_store, spec, by=Submitter(box=box))
    leaky = [PollResult(state="running", events=[
                 {"kind": "info", "message": f"rank 0 read {VALUE}", "data": {"v": VALUE}}]),
             PollResult(state="failed", error=f"RuntimeError: the server said no to {VALUE}",
                        failed_ranks=[0])]
    launcher = FakeLauncher([leaky])
    controller = Controller(sqlite_store, launcher, checkpoint_root=tmp_path / "ckpt", box=box)
    for _ in range(4):
        controller.step()
    started = launcher.started[0]["spec"]
    assert started.secret_values() == {"API_KEY": VALUE}  # for the ranks' environment
    assert VALUE not in json.dumps(started.model_dump(mode="json"))  # the spec they are sent
    done = sqlite_store.get_job(job_id=job.id)
    assert done.state == JobState.FAILED
    assert "the server said no to [secret API_KEY]" in (done.error or "")
    stored = [done.error or "", *(f"{e.message} {e.data}" for e in
                                  sqlite_store.list_events(job_id=job.id))]
    assert "rank 0 read [secret API_KEY]" in " ".join(stored)
    assert not [text for text in stored if VALUE in text]
    # A controller that cannot open them (another key) does not start the job.
    again = submit(sqlite_store, spec, by=Submitter(box=box))
    other = Controller(sqlite_store, FakeLauncher([leaky]), checkpoint_root=tmp_path / "ckpt",
                       box=SecretBox.of(SecretBox.new_key().decode(), tmp_path))
    for _ in range(3):
        other.step()
    failed = sqlite_store.get_job(job_id=again.id)
    assert failed.state == JobState.FAILED and "sealed with another key" in (failed.error or "")


def test_trident_submit_takes_secrets_from_the_environment_or_a_file_never_the_line(
        live: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(json.dumps(tiny_spec()))
    (tmp_path / "key").write_text(VALUE + "-from-file\n")
    monkeypatch.setenv("API_KEY", VALUE)
    r = live.cli("submit", str(spec_file), "-d", "--secret", "API_KEY",
                 "--secret", f"FILE_KEY=@{tmp_path / 'key'}")
    assert r.exit_code == 0, r.output
    job_id = int(r.output.strip())
    box = SecretBox.of(None, live.settings.data_dir)
    assert box.open_all(live.store.job_secrets(job_id=job_id)) == {
        "API_KEY": VALUE, "FILE_KEY": VALUE + "-from-file"}
    out = live.cli("describe", str(job_id))
    assert out.exit_code == 0 and "secrets: API_KEY, FILE_KEY (values never shown)" in out.output
    assert VALUE not in out.output
    for args, words in [(["--secret", f"API_KEY={VALUE}"], "never on the command line"),
                        (["--secret", "NOT_SET_HERE"], "no variable NOT_SET_HERE"),
                        (["--secret", "BAD=@/nonexistent/file"], "cannot read")]:
        r = live.cli("submit", str(spec_file), "-d", *args)
        assert r.exit_code == 2 and words in r.output and VALUE not in r.output, r.output
