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


def test_a_drain_asks_only_the_jobs_on_its_node_and_stops_those_late_after_its_grace(
        store: Store) -> None:
    """`Cordons` with the controller's hands faked (`FakeLoop`): the drained node's job is
    asked to save and stop, one elsewhere is not; ranks that do not stop within the grace are
    stopped, the job requeued without a retry spent; the node is drained once their group
    stopped; an uncordon gives the node back to the launcher."""
    from service.cluster.data_plane import PollResult
    from service.contract.states import JobState
    from service.control.control_pass import StepResult
    from service.control.cordons import Cordons
    from service.control.preempting import Preemptions
    from service.control.teardown import Teardowns
    from service.store import AttemptStatus
    from service.store.quota_waits import QuotaNotes
    from tests.fakes import FakeGroup, FakeLauncher, FakeLoop, live, submit

    store.upsert_nodes(nodes=[{"node_id": A, "hostname": "gpu-1"},
                              {"node_id": B, "hostname": "gpu-2"}])
    hands = FakeLoop(store, Teardowns(0.1))
    launcher = FakeLauncher([])
    preemptions = Preemptions(hands, store, launcher, hands.teardowns,  # type: ignore[arg-type]
                              QuotaNotes(store), grace_s=300, poll_timeout_s=0)
    cordons = Cordons(hands, store, launcher, hands.teardowns,  # type: ignore[arg-type]
                      preemptions)
    # Its ranks never stop by themselves: polls after the ask still say running.
    on_a = live(store, hands, FakeGroup([PollResult(state="running")],
                                        after_cancel=PollResult(state="running")),
                submit(store, name="on-a"), {"ranks": [{"rank": 0, "node_id": A},
                                                       {"rank": 1, "node_id": B}]})
    on_b = live(store, hands, FakeGroup([PollResult(state="running")]),
                submit(store, name="on-b"), {"ranks": [{"rank": 0, "node_id": B}]})
    store.cordon_node(node_id=A, by="admin", reason="BIOS", drain_grace_s=0)
    result = StepResult()
    cordons.step(result)
    assert launcher.cordoned == {A} and ("fenced", 0) in hands.calls
    assert [(c.job_id, c.to) for c in result.changes] == [(on_a.id, JobState.PREEMPTED)]
    assert hands.running[on_a.id].group.preempted
    assert not hands.running[on_b.id].group.preempted
    [asked] = [e for e in store.list_events(job_id=on_a.id) if e.data.get("to") == "PREEMPTED"]
    assert asked.message.startswith("node a10000000000 (gpu-1) is drained by admin (BIOS)")
    cordons.step(StepResult())  # asked once: not again, and not drained while it is there
    assert [n.state for n in store.list_nodes()] == ["draining", "ready"]

    preemptions.watch(store.get_job(job_id=on_a.id), hands.running[on_a.id], StepResult())
    job = store.get_job(job_id=on_a.id)
    assert (job.state, job.preemptions) == (JobState.QUEUED, 1)
    [attempt] = store.list_attempts(job_id=on_a.id)
    assert attempt.status == AttemptStatus.PREEMPTED
    assert attempt.error == "moved off node a10000000000 (gpu-1) (drained): its ranks did not" \
        " stop within 0 s"
    assert job.waiting == "moved off node a10000000000 (gpu-1) (drained); resumes from its" \
        " checkpoint when there is room"
    assert hands.teardowns.wait(30)
    cordons.step(StepResult())
    node = store.list_nodes()[0]
    assert node.state == "drained" and node.events[-1].data["moved"] == [on_a.id]
    assert store.get_job(job_id=on_b.id).state == JobState.RUNNING

    store.uncordon_node(node_id=A, by="admin")
    cordons.step(StepResult())
    assert launcher.cordoned == frozenset()


def test_the_lemon_rule_counts_only_the_nodes_of_the_failed_ranks(store: Store) -> None:
    from service.cluster.data_plane import PollResult
    from service.control.cordons import Cordons
    from service.control.preempting import Preemptions
    from service.control.teardown import Teardowns
    from service.store.quota_waits import QuotaNotes
    from tests.fakes import FakeGroup, FakeLauncher, FakeLoop, live, submit

    store.upsert_nodes(nodes=[{"node_id": A, "hostname": "gpu-1"},
                              {"node_id": B, "hostname": "gpu-2"}])
    hands = FakeLoop(store, Teardowns(0.1))
    launcher = FakeLauncher([])
    preemptions = Preemptions(hands, store, launcher, hands.teardowns,  # type: ignore[arg-type]
                              QuotaNotes(store), grace_s=300, poll_timeout_s=0)
    job = live(store, hands, FakeGroup([PollResult(state="running")]), submit(store),
               {"ranks": [{"rank": 0, "node_id": A}, {"rank": 1, "node_id": B}]})
    run = hands.running[job.id]
    off = Cordons(hands, store, launcher, hands.teardowns, preemptions)  # type: ignore[arg-type]
    off.failed(job, run, [1])  # the rule is off by default
    assert [n.cordon for n in store.list_nodes()] == [None, None]
    on = Cordons(hands, store, launcher, hands.teardowns,  # type: ignore[arg-type]
                 preemptions, lemon_failures=1, lemon_window_s=60)
    on.failed(job, run, [1])
    assert [n.state for n in store.list_nodes()] == ["ready", "cordoned"]
    [event] = [e for e in store.list_events(job_id=job.id) if e.kind == "node"]
    assert event.message.startswith("node a20000000000 (gpu-2) cordoned by the lemon rule:"
                                    f" lemon: ranks here failed 1 attempt within 60 s (job"
                                    f" {job.id} attempt 1)")


def test_a_cordoned_host_that_rejoins_as_a_new_ray_node_stays_cordoned(store: Store) -> None:
    """Ray gives a host that rejoins (a reboot, or cut off long enough to be marked dead) a
    new node id: the cordon is the host's, at its address, and goes over to the new node."""
    store.upsert_nodes(nodes=[{"node_id": A, "hostname": "gpu-1", "address": "10.0.0.1"},
                              {"node_id": B, "hostname": "gpu-2", "address": "10.0.0.2"}])
    store.cordon_node(node_id=A, by="admin", reason="fan replaced")
    store.upsert_nodes(nodes=[{"node_id": B, "hostname": "gpu-2", "address": "10.0.0.2"}])
    again = "a3" + "0" * 54
    store.upsert_nodes(nodes=[{"node_id": again, "hostname": "gpu-1", "address": "10.0.0.1"},
                              {"node_id": B, "hostname": "gpu-2", "address": "10.0.0.2"}])
    nodes = {n.node_id: n for n in store.list_nodes()}
    assert nodes[again].cordon is not None and nodes[again].cordon.reason == "fan replaced"
    assert nodes[again].state == "cordoned"
    assert "rejoined as a new Ray node" in nodes[again].events[-1].message
    assert nodes[A].cordon is None and not nodes[A].alive
    assert nodes[B].cordon is None  # a host that was not cordoned is not made so
    store.uncordon_node(node_id=again, by="admin")
    assert store.find_node("10.0.0.1").node_id == again
    assert store.find_node("10.0.0.1").state == "ready"
