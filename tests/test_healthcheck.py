"""The containers' health checks (`python -m api.compose_check`), against a real API, a real
store and its lease; the Ray node check against a stand-in agent."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from api.app import create_app
from api.compose_check import check_api, check_controller, check_ray, main
from service.settings import Settings
from service.store import Store
from service.store.lease import CONTROLLER, Leases
from service.store.tables import utcnow
from tests.conftest import migrated_sqlite
from tests.servers import free_port


def test_api_is_healthy_without_a_controller_but_not_without_its_database(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'trident.db'}"
    with TestClient(create_app(Settings(data_dir=tmp_path, database_url=url))) as client:
        assert client.get("/api/v1/healthz").status_code == 503  # no controller yet
        assert check_api(client) is None  # ... which is the controller's health, not the API's
    broken = Store(f"sqlite:///{tmp_path / 'missing' / 'trident.db'}")
    with TestClient(create_app(Settings(data_dir=tmp_path), store=broken)) as client:
        problem = check_api(client)
    assert problem is not None and "does not reach the database" in problem


def test_api_that_does_not_answer_is_unhealthy() -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{free_port()}", timeout=5) as client:
        problem = check_api(client)
    assert problem is not None and "does not answer" in problem
    assert main(["api", f"http://127.0.0.1:{free_port()}"]) == 1


def test_controller_is_healthy_while_a_controller_holds_the_lease(tmp_path: Path) -> None:
    url = migrated_sqlite(tmp_path / "trident.db")
    store = Store(url)
    settings = Settings(data_dir=tmp_path, database_url=url)
    try:
        problem = check_controller(settings)
        assert problem is not None and "no controller has held the lease" in problem
        leases = Leases(store)
        held, _ = leases.acquire(name=CONTROLLER, holder="other:1:a", duration_s=5,
                                 now=utcnow() - timedelta(seconds=60))
        assert held
        problem = check_controller(settings)  # held once, expired now
        assert problem is not None and "not renewed its lease in time" in problem
        held, _ = leases.acquire(name=CONTROLLER, holder="other:1:a", duration_s=60)
        assert held and check_controller(settings) is None
    finally:
        store.close()
    gone = Settings(data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'no' / 'x.db'}")
    problem = check_controller(gone)
    assert problem is not None and "database does not answer" in problem


def test_ray_node_is_judged_by_its_agent() -> None:
    asked: list[str] = []

    def agent(status: int) -> httpx.Client:
        def answer(request: httpx.Request) -> httpx.Response:
            asked.append(request.url.path)
            return httpx.Response(status, text="success" if status == 200 else "Local Raylet"
                                  " failed")
        return httpx.Client(base_url="http://ray", transport=httpx.MockTransport(answer))

    assert check_ray(agent(200)) is None
    problem = check_ray(agent(503))
    assert problem is not None and "Local Raylet failed" in problem
    assert asked == ["/api/healthz", "/api/healthz"]
    assert main(["ray", f"http://127.0.0.1:{free_port()}"]) == 1


def test_an_unknown_check_is_a_usage_error() -> None:
    assert main([]) == 2 and main(["postgres"]) == 2
