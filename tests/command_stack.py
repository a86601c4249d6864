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
from tests.conftest import authed_client, migrated_sqlite, ray_namespace

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "command"


@pytest.fixture
def stack(local_ray: None, tmp_path: Path) -> Iterator[tuple[TestClient, Store, Controller]]:
    """The API (an admin's token) and a controller on the shared Ray whose rank logs are
    kept, on a server whose code root holds the example scripts."""
    from api.app import create_app
    from service.files.order_cache import ServerData
    from service.settings import Settings
    from workers.launch.launcher import RayLauncher

    store = Store(migrated_sqlite(tmp_path / "e2e.db"))
    settings = Settings(data_dir=tmp_path, code_roots=str(EXAMPLES))
    with ray_namespace() as namespace:
        controller = Controller(store, RayLauncher(log_root=settings.log_root,
                                                   server=ServerData.of(settings),
                                                   namespace=namespace),
                                checkpoint_root=tmp_path / "ckpt", start_timeout_s=120,
                                cancel_grace_s=5, data_dir=tmp_path)
        with authed_client(create_app(settings, store=store), store) as client:
            yield client, store, controller
        controller.shutdown(stop_jobs=True)
    store.close()


def logs(client: TestClient, job_id: int, attempt: int) -> dict[int, str]:
    r = client.get(f"/api/v1/jobs/{job_id}/logs", params={"attempt": attempt})
    assert r.status_code == 200, r.text
    return {c["rank"]: c["text"] for c in r.json()["ranks"]}
