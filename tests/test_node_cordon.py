"""Cordon, drain and uncordon through the API (`POST /api/v1/nodes/{host}/...`): admins only,
audited, a HOST named by id, id prefix, hostname or address (404 unknown, 422 ambiguous), the
node's state in `GET /api/v1/cluster`; and the store's lemon rule (`note_node_failures`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.settings import Settings
from service.store import Store
from tests.conftest import user_token

A, B, C = "a1" + "0" * 54, "a2" + "0" * 54, "b1" + "0" * 54


@pytest.fixture
def client(store: Store, tmp_path: Path) -> Iterator[TestClient]:
    store.upsert_nodes(nodes=[
        {"node_id": A, "hostname": "gpu-1", "address": "10.0.0.1"},
        {"node_id": B, "hostname": "gpu-2", "address": "10.0.0.2"},
        {"node_id": C, "hostname": "gpu-2", "address": "10.0.0.3"}])
    with TestClient(create_app(Settings(data_dir=tmp_path), store=store)) as c:
        yield c


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def node(client: TestClient, token: str, node_id: str) -> dict[str, Any]:
    nodes = client.get("/api/v1/cluster", headers=bearer(token)).json()["nodes"]
    return next(n for n in nodes if n["node_id"] == node_id)


def test_an_admin_cordons_drains_and_uncordons_and_every_call_is_audited(
        client: TestClient, store: Store) -> None:
    admin, alice = user_token(store), user_token(store, "alice", "member")
    assert node(client, alice, A)["state"] == "ready" and node(client, alice, A)["cordon"] is None

    r = client.post("/api/v1/nodes/gpu-1/cordon", json={"reason": "fan noise"},
                    headers=bearer(admin))
    assert r.status_code == 200, r.text
    assert r.json()["node_id"] == A and r.json()["state"] == "cordoned"
    seen = node(client, alice, A)  # any user reads it
    assert seen["state"] == "cordoned"
    assert (seen["cordon"]["by"], seen["cordon"]["reason"]) == ("admin", "fan noise")
    assert seen["cordon"]["drain_deadline"] is None
    assert [e["kind"] for e in seen["events"]] == ["cordon"]
    # A second cordon keeps the first one's who and why.
    client.post("/api/v1/nodes/gpu-1/cordon", json={"reason": "other"}, headers=bearer(admin))
    assert node(client, alice, A)["cordon"]["reason"] == "fan noise"

    r = client.post("/api/v1/nodes/10.0.0.2/drain", json={"grace_s": 60, "reason": "BIOS"},
                    headers=bearer(admin))
    assert r.status_code == 200, r.text
    drained = r.json()
    assert drained["node_id"] == B and drained["state"] == "draining"
    assert drained["cordon"]["drain_deadline"] is not None
    assert "within 60 s" in drained["events"][-1]["message"]

    r = client.post("/api/v1/nodes/a1/uncordon", headers=bearer(admin))  # an id prefix
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "ready" and r.json()["cordon"] is None
    assert [e["kind"] for e in r.json()["events"]] == ["cordon", "uncordon"]

    items = client.get("/api/v1/audit", headers=bearer(admin)).json()["items"]
    got = [(e["actor"], e["path"], e["action"], e["status"]) for e in items]
    assert got == [("admin", "/api/v1/nodes/gpu-1/cordon", "nodes:cordon", 200),
                   ("admin", "/api/v1/nodes/gpu-1/cordon", "nodes:cordon", 200),
                   ("admin", "/api/v1/nodes/10.0.0.2/drain", "nodes:drain", 200),
                   ("admin", "/api/v1/nodes/a1/uncordon", "nodes:uncordon", 200)]


def test_only_admins_may_and_a_refusal_is_audited(client: TestClient, store: Store) -> None:
    admin = user_token(store)
    for name, role in (("alice", "member"), ("vic", "viewer")):
        token = user_token(store, name, role)
        for verb in ("cordon", "drain", "uncordon"):
            r = client.post(f"/api/v1/nodes/gpu-1/{verb}", headers=bearer(token))
            assert r.status_code == 403, r.text
            assert f"only admins {verb} nodes" in r.json()["detail"]
    assert node(client, admin, A)["state"] == "ready"
    items = client.get("/api/v1/audit", headers=bearer(admin)).json()["items"]
    assert [(e["actor"], e["action"], e["status"]) for e in items][:3] == [
        ("alice", "nodes:cordon", 403), ("alice", "nodes:drain", 403),
        ("alice", "nodes:uncordon", 403)]


def test_an_unknown_or_ambiguous_host_or_a_bad_body_is_refused(
        client: TestClient, store: Store) -> None:
    admin = bearer(user_token(store))
    r = client.post("/api/v1/nodes/gpu-9/cordon", headers=admin)
    assert r.status_code == 404 and "no node 'gpu-9'" in r.json()["detail"]
    r = client.post("/api/v1/nodes/gpu-2/cordon", headers=admin)  # two nodes of that name
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["path", "host"]
    assert "names 2 nodes" in r.json()["detail"][0]["msg"]
    r = client.post("/api/v1/nodes/a/drain", headers=admin)  # a prefix of two ids
    assert r.status_code == 422 and "names 2 nodes" in r.json()["detail"][0]["msg"]
    r = client.post("/api/v1/nodes/a%20b/cordon", headers=admin)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "host"]
    r = client.post("/api/v1/nodes/gpu-1/cordon", json={"reason": "x" * 501}, headers=admin)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "reason"]
    r = client.post("/api/v1/nodes/gpu-1/drain", json={"grace_s": -1}, headers=admin)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "grace_s"]
    r = client.post("/api/v1/nodes/gpu-1/drain", json={"grace_s": 10, "force": True},
                    headers=admin)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "force"]
    # A dead node has nothing to drain; the alive one of a name wins over a dead one.
    store.upsert_nodes(nodes=[{"node_id": A, "hostname": "gpu-1", "address": "10.0.0.1"},
                              {"node_id": C, "hostname": "gpu-2", "address": "10.0.0.3"}])
    r = client.post(f"/api/v1/nodes/{B}/drain", headers=admin)
    assert r.status_code == 409 and "is dead" in r.json()["detail"]
    r = client.post("/api/v1/nodes/gpu-2/cordon", headers=admin)
    assert r.status_code == 200 and r.json()["node_id"] == C
    assert r.json()["cordon"]["reason"] == "cordoned with no reason given"


def test_the_lemon_rule_cordons_a_node_after_n_failed_attempts_within_its_window(
        store: Store) -> None:
    store.upsert_nodes(nodes=[{"node_id": A, "hostname": "gpu-1"},
                              {"node_id": B, "hostname": "gpu-2"}])
    assert store.note_node_failures(node_ids=[A, B], job_id=1, attempt=1, threshold=3,
                                    window_s=600) == []
    assert store.note_node_failures(node_ids=[A], job_id=2, attempt=1, threshold=3,
                                    window_s=600) == []
    [lemon] = store.note_node_failures(node_ids=[A], job_id=1, attempt=2, threshold=3,
                                       window_s=600)
    assert lemon.node_id == A and lemon.state == "cordoned" and lemon.cordon is not None
    assert lemon.cordon.by == "trident"
    assert lemon.cordon.reason.startswith("lemon: ranks here failed 3 attempts within 600 s"
                                          " (job 1 attempt 1, job 2 attempt 1, job 1 attempt 2)")
    assert lemon.events[-1].kind == "lemon"
    assert {n.node_id: n.state for n in store.list_nodes()} == {A: "cordoned", B: "ready"}
    # Outside the window the old failures no longer count.
    assert store.note_node_failures(node_ids=[B], job_id=3, attempt=1, threshold=3,
                                    window_s=0) == []
    assert store.note_node_failures(node_ids=[B], job_id=3, attempt=2, threshold=2,
                                    window_s=0) == []
    # Uncordoned, it counts afresh.
    store.uncordon_node(node_id=A, by="admin")
    assert store.note_node_failures(node_ids=[A], job_id=4, attempt=1, threshold=2,
                                    window_s=600) == []
