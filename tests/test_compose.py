"""The production stack agrees with the code: `docker-compose.yml` is valid as
`docker-compose config` (Debian's docker-compose, which `make install` installs) reads it; every
Trident service runs one image built from the repository's Dockerfile (CPU or CUDA by build
argument) with nothing installed at start; every service has a health check and a restart
policy; the environment names only settings `service.settings.Settings` reads, and they point
at the stack's own PostgreSQL and Ray head; the controller is the supervised, leased daemon.

Nothing is built or run: that needs a Docker daemon and registries."""

from __future__ import annotations

import inspect
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import make_url

from cli.main import app as cli_app
from service.cluster.supervisor import run_controller
from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
TRIDENT_PREFIX = Settings.model_config.get("env_prefix", "")
SETTING_NAMES = {f"{TRIDENT_PREFIX}{name}".upper() for name in Settings.model_fields}
RESTART_POLICIES = {"always", "unless-stopped", "on-failure"}
INSTALLERS = re.compile(r"\b(pip3?|uv|conda|mamba|apt-get|apt|apk|dnf|yum)\b.*\binstall\b")


def compose_config(**variables: str) -> dict[str, Any]:
    """`docker-compose config` of the repository's file (every profile), with these variables
    and no others that the file interpolates."""
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is missing: `make install` installs Debian's package"
    env = {k: v for k, v in os.environ.items()
           if k not in ("VARIANT", "POSTGRES_PASSWORD", "RAY_AUTH_TOKEN")}
    out = subprocess.run([binary, "--project-directory", str(ROOT), "-f",
                          str(ROOT / "docker-compose.yml"), "--profile", "gpu", "config"],
                         capture_output=True, text=True, env={**env, **variables}, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, f"docker-compose config failed:\n{out.stderr}"
    config = yaml.safe_load(out.stdout)
    assert isinstance(config, dict)
    return config


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return compose_config(RAY_AUTH_TOKEN="t0ken")["services"]


def test_every_ray_node_and_driver_shares_the_clusters_token(
        services: dict[str, dict[str, Any]]) -> None:
    """`ray start --head` turns Ray's token authentication on: the controller (a driver) and
    every node need the same token, and the file refuses to start without one."""
    for name in ("ray-head", "ray-gpu-worker", "controller", "api"):
        env = services[name]["environment"]
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == "t0ken", name
    binary = shutil.which("docker-compose")
    assert binary
    out = subprocess.run([binary, "--project-directory", str(ROOT), "-f",
                          str(ROOT / "docker-compose.yml"), "config"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"})
    assert out.returncode != 0 and "RAY_AUTH_TOKEN" in out.stderr


def trident(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The services that run the Trident image (the others are PostgreSQL's)."""
    return {name: s for name, s in services.items() if "build" in s}


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions, (KEYWORD, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, args = line.partition(" ")
            rows.append((keyword.upper(), args.strip()))
    return rows


def seconds(duration: str) -> float:
    """A compose duration (`1m30s`, `90s`, `500ms`) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def command(service: dict[str, Any]) -> str:
    cmd = service.get("command", "")
    return cmd if isinstance(cmd, str) else shlex.join(cmd)


def test_the_file_is_valid_and_names_the_stack(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {"postgres", "api", "controller", "ray-head", "ray-gpu-worker"}
    assert set(trident(services)) == {"api", "controller", "ray-head", "ray-gpu-worker"}


def test_one_image_built_from_the_dockerfile(services: dict[str, dict[str, Any]]) -> None:
    ours = trident(services)
    builds = {yaml.safe_dump(s["build"]) for s in ours.values()}
    images = {s["image"] for s in ours.values()}
    assert len(builds) == 1 and images == {"trident:cpu"}, (builds, images)
    build = ours["api"]["build"]
    assert Path(build["context"]) == ROOT and build.get("dockerfile", "Dockerfile") == "Dockerfile"
    assert build["args"] == {"VARIANT": "cpu"}
    # The variant is a build argument: CUDA is the same file with another value.
    cuda = trident(compose_config(VARIANT="cuda", RAY_AUTH_TOKEN="t0ken")["services"])
    assert {s["image"] for s in cuda.values()} == {"trident:cuda"}
    assert {s["build"]["args"]["VARIANT"] for s in cuda.values()} == {"cuda"}


def test_the_dockerfile_has_a_stage_per_variant() -> None:
    rows = dockerfile()
    first_from = next(i for i, (k, _) in enumerate(rows) if k == "FROM")
    assert ("ARG", "VARIANT=cpu") in rows[:first_from]  # a global ARG, usable in FROM
    stages = {args.split()[-1] for k, args in rows if k == "FROM" and " AS " in args.upper()}
    assert {"torch-cpu", "torch-cuda"} <= stages
    assert any(k == "FROM" and args.startswith("torch-${VARIANT}") for k, args in rows)
    # The torch it pins is the one `make install` installs.
    make_torch = re.search(r'"torch==([^"]+)"', (ROOT / "Makefile").read_text())
    assert make_torch and ("ARG", f"TORCH_VERSION={make_torch.group(1)}") in rows
    # The project is installed while building, and the image does not run as root.
    assert any(k == "RUN" and re.search(r"\bpip install \.(\s|$)", a) for k, a in rows)
    users = [a for k, a in rows if k == "USER"]
    assert users and users[-1] not in ("root", "0")
    # The build context admits what the Dockerfile copies.
    admitted = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.startswith("!")}
    copied = {src for k, a in rows if k == "COPY" for src in a.split()[:-1]}
    assert copied and copied <= admitted and all((ROOT / src).exists() for src in copied)
    # Every package the project installs is copied into the image.
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {name.rstrip("*") for name in find["packages"]["find"]["include"]}
    assert packages <= copied, packages - copied


def test_nothing_is_installed_when_a_container_starts(
        services: dict[str, dict[str, Any]]) -> None:
    for name, s in services.items():
        assert not INSTALLERS.search(command(s)), f"{name} installs at start: {command(s)}"
        assert not INSTALLERS.search(command({"command": s.get("entrypoint", "")})), name
    starts = [a for k, a in dockerfile() if k in ("CMD", "ENTRYPOINT")]
    assert starts and not any(INSTALLERS.search(a) for a in starts)
    # The code comes from the image, not from a bind mount of the source tree.
    for name, s in trident(services).items():
        assert all(v["type"] == "volume" if isinstance(v, dict) else not v.startswith(("/", "."))
                   for v in s.get("volumes", [])), name


def test_every_service_has_a_healthcheck_and_a_restart_policy(
        services: dict[str, dict[str, Any]]) -> None:
    for name, s in services.items():
        check = s.get("healthcheck") or {}
        assert not check.get("disable") and check.get("test"), f"{name}: no health check"
        assert check["test"][0] in ("CMD", "CMD-SHELL") and check["test"][1:], name
        assert s.get("restart") in RESTART_POLICIES, f"{name}: restart {s.get('restart')}"


def test_the_environment_is_the_settings_the_code_reads(
        services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    ours = trident(services)
    for name, s in ours.items():
        unknown = {k for k in s.get("environment", {}) if k.startswith(TRIDENT_PREFIX.upper())
                   and k not in SETTING_NAMES}
        assert not unknown, f"{name}: {sorted(unknown)} are not settings of Settings"
    env = ours["api"]["environment"]
    assert ours["controller"]["environment"] == env  # one configuration for both processes
    image_env = {pair.split("=", 1)[0] for k, a in dockerfile() if k == "ENV"
                 for pair in a.split()}
    assert {k for k in image_env if k.startswith("TRIDENT_")} <= SETTING_NAMES
    for key in list(os.environ):
        if key.startswith("TRIDENT_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    settings = Settings()  # valid, including the production checks
    assert settings.env == "prod"
    db = make_url(settings.db_url)
    pg = services["postgres"]["environment"]
    assert db.get_backend_name() == "postgresql" and (db.host, db.port) == ("postgres", 5432)
    assert (db.username, db.password, db.database) == (
        pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], pg["POSTGRES_DB"])
    ray_host, _, ray_port = settings.ray_address.partition(":")
    assert ray_host == "ray-head" and f"--port {ray_port}" in command(services["ray-head"])
    # The data directory (checkpoints the ranks write, logs) is one volume on every node.
    for name, s in ours.items():
        assert f"trident-data:{settings.data_dir}:rw" in s["volumes"], name


def test_the_healthchecks_check_what_the_services_run(
        services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    pg = services["postgres"]
    assert pg["healthcheck"]["test"][1] == "pg_isready"
    assert pg["environment"]["POSTGRES_USER"] in pg["healthcheck"]["test"]
    checks = {name: s["healthcheck"]["test"][1:] for name, s in trident(services).items()}
    for name, test in checks.items():
        assert test[:3] == ["python", "-m", "api.compose_check"], name
    port = re.search(r"--port (\d+)", command(services["api"]))
    assert port and checks["api"][3:] == ["api", f"http://127.0.0.1:{port.group(1)}"]
    assert checks["controller"][3:] == ["controller"]
    for name, s in trident(services).items():
        if command(s).startswith("ray start"):
            assert checks[name][3:] == ["ray"], name
    # A normal hand-over (a standby takes the lease within TRIDENT_LEASE_S) is not reported
    # as an unhealthy controller.
    for key, value in services["controller"]["environment"].items():
        monkeypatch.setenv(key, str(value))
    check = services["controller"]["healthcheck"]
    assert seconds(check["interval"]) * check["retries"] > Settings().lease_s


def test_the_controller_is_the_supervised_leased_daemon(
        services: dict[str, dict[str, Any]]) -> None:
    ctl = services["controller"]
    steps = [step.strip() for step in ctl["command"][-1].split("&&")]
    assert ctl["command"][:2] == ["sh", "-c"] and steps[-1] == "exec trident controller"
    assert "controller" in [c.name or c.callback.__name__ for c in cli_app.registered_commands
                            if c.callback]
    # It joins the Ray cluster it is configured with (a driver runs on a node), and offers
    # that cluster no resources of its own.
    ray = shlex.split(steps[0])
    address = ctl["environment"]["TRIDENT_RAY_ADDRESS"]
    assert ray[:4] == ["ray", "start", "--address", address]
    assert {"--num-cpus", "--num-gpus"} <= set(ray) and "--head" not in ray
    assert ctl["depends_on"] == {"api": {"condition": "service_healthy"},
                                 "ray-head": {"condition": "service_healthy"}}
    # Compose waits longer than the supervisor gives the daemon to stop and release the lease.
    grace = inspect.signature(run_controller).parameters["grace_s"].default
    assert seconds(ctl["stop_grace_period"]) > grace
