"""A `command:` job's test stack: the API and a controller on the shared local Ray, on a server
whose code root holds the example scripts (`examples/command`); shared by the modules that run
those scripts through REST (tests/test_command_ray.py, tests/test_command_hf_ray.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.control.controller import Controller
from service.store import Store
from tests.conftest import ray_stack

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "command"


@pytest.fixture
def stack(local_ray: None, tmp_path: Path) -> Iterator[tuple[TestClient, Store, Controller]]:
    """The API (an admin's token) and a controller on the shared Ray whose rank logs are
    kept, on a server whose code root holds the example scripts."""
    from service.settings import Settings

    settings = Settings(data_dir=tmp_path, code_roots=str(EXAMPLES))
    with ray_stack(tmp_path, settings, log_root=settings.log_root) as got:
        yield got


def logs(client: TestClient, job_id: int, attempt: int) -> dict[int, str]:
    r = client.get(f"/api/v1/jobs/{job_id}/logs", params={"attempt": attempt})
    assert r.status_code == 200, r.text
    return {c["rank"]: c["text"] for c in r.json()["ranks"]}
