"""The `trident` CLI against a real API server (uvicorn on a free port). The whole local stack
(`trident up`) running the demo job is in tests/test_e2e_loopback.py, on its shared stack."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from cli.main import app
from service.settings import Settings
from tests.servers import HTTP, ROOT, admin_headers, free_port

runner = CliRunner()


def test_validate_fills_defaults() -> None:
    r = runner.invoke(app, ["validate", str(ROOT / "examples/tiny.yaml")])
    assert r.exit_code == 0, r.output
    assert '"zero": 2' in r.output and '"ffn_hidden": 256' in r.output


def test_bad_spec_file_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {preset: gpt-tiny}\nparallel: {tp: 3}\n")
    r = runner.invoke(app, ["validate", str(bad)])
    assert r.exit_code == 2
    assert "tp(3) does not divide heads(4)" in r.output
    bad.write_text("name: x\nmodel: {preset: gpt-tiny}\ntrain: {stepz: 3}\n")
    r = runner.invoke(app, ["submit", str(bad), "--server", "http://127.0.0.1:9"])
    assert r.exit_code == 2 and "train.stepz: Extra inputs are not permitted" in r.output
    r = runner.invoke(app, ["validate", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and "cannot read" in r.output


def test_submit_status_cancel(server: str) -> None:
    r = runner.invoke(app, ["submit", str(ROOT / "examples/tiny.yaml"), "-d", "--server",
                            server])
    assert r.exit_code == 0, r.output
    job_id = int(r.output.strip())
    r = runner.invoke(app, ["status", "--server", server])
    assert r.exit_code == 0 and re.search(rf"^{job_id} +tiny-zero2 .* QUEUED ", r.output, re.M)
    r = runner.invoke(app, ["status", str(job_id), "--server", server])
    assert "QUEUED" in r.output and "tp1 pp1 dp2 zero2" in r.output
    r = runner.invoke(app, ["cancel", str(job_id), "--yes", "--server", server])
    assert r.exit_code == 0 and "CANCELLED" in r.output
    r = runner.invoke(app, ["cancel", str(job_id), "--yes", "--server", server])
    assert r.exit_code == 1 and "409" in r.output
    r = runner.invoke(app, ["events", str(job_id), "--server", server])
    assert "cancelled while queued" in r.output
    r = runner.invoke(app, ["status", "999", "--server", server])
    assert r.exit_code == 2 and "404" in r.output


def test_every_example_validates() -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        r = runner.invoke(app, ["validate", str(path)])
        assert r.exit_code == 0, (path, r.output)


def test_yaml_numbers_are_numbers(tmp_path: Path) -> None:
    """`3e-4` is a float (PyYAML alone reads it as a string); quoted numbers and booleans
    are refused, as they are over REST."""
    spec = tmp_path / "s.yaml"
    spec.write_text("name: x\nmodel: {preset: gpt-tiny}\ntrain: {lr: 3e-4, steps: 4}\n")
    r = runner.invoke(app, ["validate", str(spec)])
    assert r.exit_code == 0 and '"lr": 0.0003' in r.output, r.output
    for bad in ('"40"', "true", "4.0"):
        spec.write_text(f"name: x\nmodel: {{preset: gpt-tiny}}\ntrain: {{steps: {bad}}}\n")
        r = runner.invoke(app, ["validate", str(spec)])
        assert r.exit_code == 2 and "train.steps: Input should be a valid integer" in r.output


def test_submit_retries_under_one_idempotency_key(server: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The first answer is lost after the server queued the job; the retry gets that job."""
    import cli.jobs
    from client.rest import TridentClient

    keys: list[str] = []
    real = httpx.HTTPTransport()

    class LosesFirstAnswer(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            response = real.handle_request(request)
            if request.method == "POST":
                keys.append(request.headers["idempotency-key"])
                if len(keys) == 1:
                    response.read()
                    raise httpx.ReadError("connection reset", request=request)
            return response

    monkeypatch.setattr(cli.jobs, "connect", lambda s: TridentClient(
        s, transport=LosesFirstAnswer()))
    r = runner.invoke(app, ["submit", str(ROOT / "examples/tiny.yaml"), "-d", "--server",
                            server])
    assert r.exit_code == 0, r.output
    jobs = HTTP.get(server + "/api/v1/jobs", headers=admin_headers(tmp_path)).json()
    assert jobs["total"] == 1 and int(r.output.strip()) == jobs["items"][0]["id"]
    assert len(keys) == 2 and keys[0] == keys[1]
    # Another invocation is another job, under another key.
    r = runner.invoke(app, ["submit", str(ROOT / "examples/tiny.yaml"), "-d", "--server",
                            server])
    assert r.exit_code == 0 and len(set(keys)) == 2
    assert HTTP.get(server + "/api/v1/jobs",
                    headers=admin_headers(tmp_path)).json()["total"] == 2


def test_unreachable_server_is_a_clear_error() -> None:
    r = runner.invoke(app, ["status", "--server", f"http://127.0.0.1:{free_port()}"])
    assert r.exit_code == 2 and "cannot reach the Trident API" in r.output


def test_identity_commands_over_the_api(server_on_each_db: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """login, whoami, user add/list/disable, token create/list/revoke, project
    add/quota/budget/list;
    the token comes from TRIDENT_TOKEN, else the login profile, else the bootstrap file."""
    server = server_on_each_db
    def run(*args: str) -> str:
        r = runner.invoke(app, [*args, "--server", server])
        assert r.exit_code == 0, (args, r.output)
        return r.output

    assert run("whoami").startswith("admin (admin); projects: default")  # the bootstrap file
    assert "quota 24 GPUs, - CPUs" in run("project", "add", "vision", "--gpus", "24")
    assert "user alice (member); projects: vision" in run("user", "add", "alice", "--project",
                                                          "vision")
    created = runner.invoke(app, ["token", "create", "laptop", "--user", "alice",
                                  "--server", server])
    assert created.exit_code == 0, created.output
    secret = created.stdout.splitlines()[0]
    assert secret.startswith("trd_") and "shown once" in created.stderr
    out = run("login", "--token", secret)
    assert f"logged in to {server} as alice (member)" in out
    profile = tmp_path / "config" / "profiles.json"
    assert oct(profile.stat().st_mode & 0o777) == "0o600"
    assert run("whoami").startswith("alice (member); projects: vision;")  # the profile
    job_id = int(run("submit", str(ROOT / "examples/tiny.yaml"), "--detach").strip())
    listing = run("status", "--owner", "alice", "-o", "wide")
    assert re.search(rf"^{job_id} +tiny-zero2 +alice +vision .* QUEUED ", listing, re.M), listing
    r = runner.invoke(app, ["user", "list", "--server", server])
    assert r.exit_code == 2 and "403: users:manage: only admins manage users" in r.output
    tokens = run("token", "list")
    assert "laptop" in tokens and "bootstrap" not in tokens  # a member sees only their own
    # TRIDENT_TOKEN comes first: the admin again.
    monkeypatch.setenv("TRIDENT_TOKEN", (tmp_path / "admin.token").read_text().strip())
    assert "bootstrap" in run("token", "list")
    assert re.search(r"alice +member +active +vision", run("user", "list"))
    assert "quota 8 GPUs, 16 CPUs, max priority 10" in run(
        "project", "quota", "vision", "--gpus", "8", "--cpus", "16", "--max-priority", "10")
    assert re.search(r"vision +GPUs +8 +CPUs +16 +alice", run("project", "list"))
    assert ("project vision: budget - GPU-hours, 12.5 CPU-hours, - in cost since"
            " 2026-12-01T00:00:00Z; running jobs stopped when spent") in run(
        "project", "budget", "vision", "--cpu-hours", "12.5", "--since", "2026-12-01",
        "--stop-running")
    r = runner.invoke(app, ["project", "budget", "vision", "--cost", "5", "--server", server])
    assert r.exit_code == 2 and "cost: this server sets no prices" in r.output, r.output
    assert "project vision: no budget" in run("project", "budget", "vision", "--remove")
    laptop = next(line.split()[0] for line in run("token", "list").splitlines()
                  if "laptop" in line)
    assert "revoked" in run("token", "revoke", laptop)
    monkeypatch.delenv("TRIDENT_TOKEN")
    r = runner.invoke(app, ["whoami", "--server", server])
    assert r.exit_code == 2 and "401: token 'laptop' of alice was revoked" in r.output
    assert "run `trident login`" in r.output
    monkeypatch.setenv("TRIDENT_TOKEN", (tmp_path / "admin.token").read_text().strip())
    assert "user alice disabled" in run("user", "disable", "alice")


def test_trident_ups_first_start_says_where_the_admin_token_is(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What `trident up` prints before it starts anything (the slow demo test runs it all):
    the database opened (`service.store.opening`, which `python -m api.serve` calls too),
    its first admin made once."""
    from cli.identity import open_database
    from service.store import opening

    settings = Settings(data_dir=tmp_path)
    open_database(settings)
    path = tmp_path / "admin.token"
    assert capsys.readouterr().out == (
        f"first start: created the admin user; its API token is in {path} (readable by you"
        " only; the CLI uses it for this local server)\n")
    assert path.stat().st_mode & 0o777 == 0o600
    open_database(settings)  # a later start: the same file, nothing created
    assert capsys.readouterr().out == f"admin token: {path}\n"
    prod, said = tmp_path / "prod", []  # as in prod: the schema, never an admin of its own
    prod.mkdir()
    opening.open_database(Settings(data_dir=prod).db_url, prod, first_admin=False,
                          say=said.append)
    assert said == [] and not (prod / "admin.token").exists()


def test_bootstrap_creates_the_first_admin_once(tmp_path: Path) -> None:
    r = runner.invoke(app, ["bootstrap", "--data-dir", str(tmp_path)])
    assert r.exit_code == 0 and f"its API token is in {tmp_path / 'admin.token'}" in r.output
    assert (tmp_path / "admin.token").stat().st_mode & 0o077 == 0
    r = runner.invoke(app, ["bootstrap", "--data-dir", str(tmp_path)])
    assert r.exit_code == 1 and "users exist already" in r.output


def test_the_cli_finds_its_token_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRIDENT_TOKEN, else the `trident login` profile of that server, else (a server on this
    machine only) the bootstrap file in TRIDENT_DATA_DIR, by default ./var: where `make demo`
    (examples/demo.sh: `trident up --data-dir var` from the repository) has its server write
    it, so the demo needs no step of its own."""
    from client.token import save_profile, token_for

    monkeypatch.delenv("TRIDENT_TOKEN", raising=False)
    monkeypatch.delenv("TRIDENT_DATA_DIR", raising=False)
    monkeypatch.setenv("TRIDENT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    local, remote = "http://127.0.0.1:8000", "https://trident.example:8000"
    assert token_for(local) == (None, "nowhere")
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "admin.token").write_text("trd_demo\n")
    assert token_for(local) == ("trd_demo", f"the bootstrap token file {tmp_path}/var/admin.token")
    assert token_for("http://localhost:8000")[0] == "trd_demo"
    assert token_for(remote) == (None, "nowhere")  # never sent to another machine
    monkeypatch.setenv("TRIDENT_DATA_DIR", str(tmp_path / "elsewhere"))
    assert token_for(local) == (None, "nowhere")
    save_profile(local + "/", "trd_profile", "alice")
    assert token_for(local)[0] == "trd_profile"
    assert token_for(remote) == (None, "nowhere")
    monkeypatch.setenv("TRIDENT_TOKEN", "trd_env")
    assert token_for(local) == ("trd_env", "TRIDENT_TOKEN")
    assert token_for(remote) == ("trd_env", "TRIDENT_TOKEN")
