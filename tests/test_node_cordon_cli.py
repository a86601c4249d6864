"""`trident node cordon|drain|uncordon HOST` and the node states in `trident cluster`, against a
live API server (`live`): an admin's token, and a member's refused with one line."""

from __future__ import annotations

import json

import pytest

from tests.cli_stack import Live
from tests.conftest import user_token

A, B = "c0ffee" + "0" * 50, "beef00" + "0" * 50


def test_an_admin_cordons_drains_and_uncordons_nodes_and_the_cluster_shows_it(
        live: Live) -> None:
    live.store.upsert_nodes(nodes=[
        {"node_id": A, "hostname": "gpu-1", "address": "10.0.0.1", "accelerator": "cpu",
         "cpus": 4, "resources": {"CPU": 4.0}},
        {"node_id": B, "hostname": "gpu-2", "address": "10.0.0.2", "accelerator": "cpu",
         "cpus": 4, "resources": {"CPU": 4.0}}])
    r = live.cli("node", "cordon", "gpu-1", "--reason", "fan noise")
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"node {A[:12]} (gpu-1, 10.0.0.1) cordoned by admin: fan noise"
    r = live.cli("node", "drain", "10.0.0.2", "--grace", "30")
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"node {B[:12]} (gpu-2, 10.0.0.2) draining: no job has ranks" \
        " there"

    r = live.cli("cluster")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split()[2] == "STATE"
    states = {ln.split()[0]: ln.split()[2] for ln in lines[1:3]}
    assert states == {A[:12]: "cordoned", B[:12]: "draining"}
    assert any(ln.startswith(f"node {A[:12]} (gpu-1, 10.0.0.1) cordoned by admin at ")
               and ln.endswith(": fan noise") for ln in lines)
    assert any(ln.startswith(f"node {B[:12]}") and ln.endswith(": drained with no reason"
                                                              " given") for ln in lines)
    shown = json.loads(live.cli("cluster", "-o", "json").output)
    assert {n["node_id"]: n["state"] for n in shown["nodes"]} == {A: "cordoned", B: "draining"}

    r = live.cli("node", "uncordon", A[:6])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"node {A[:12]} (gpu-1, 10.0.0.1) ready: new ranks may be" \
        " placed there"
    lines = live.cli("cluster").output.splitlines()
    assert {ln.split()[0]: ln.split()[2] for ln in lines[1:3]} == {A[:12]: "alive",
                                                                   B[:12]: "draining"}


def test_a_member_or_an_unknown_host_gets_one_line(live: Live,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    live.store.upsert_nodes(nodes=[{"node_id": A, "hostname": "gpu-1"}])
    r = live.cli("node", "cordon", "gpu-9")
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and "no node 'gpu-9'" in r.output
    assert len(r.output.strip().splitlines()) == 1
    monkeypatch.setenv("TRIDENT_TOKEN", user_token(live.store, "alice", "member"))
    r = live.cli("node", "drain", "gpu-1")
    assert r.exit_code == 2, r.output
    assert "only admins drain nodes" in r.output and len(r.output.strip().splitlines()) == 1
    assert live.store.list_nodes()[0].state == "ready"


def test_the_cluster_shows_a_node_a_probe_found_with_a_slow_link_until_it_is_healthy(
        live: Live) -> None:
    live.store.upsert_nodes(nodes=[
        {"node_id": A, "hostname": "gpu-1", "address": "10.0.0.1", "accelerator": "cpu",
         "cpus": 4, "resources": {"CPU": 4.0}}])
    said = "slow link: host 10.0.0.1 measured 1 MB/s to its peers"
    assert live.store.mark_slow_link(node_id=A, slow=True, by="job 7", message=said,
                                     data={"bw": 1e6})
    assert not live.store.mark_slow_link(node_id=A, slow=True, by="job 8", message=said)
    lines = live.cli("cluster").output.splitlines()
    assert any(ln.startswith(f"node {A[:12]} (gpu-1, 10.0.0.1) slow link since ")
               and ln.endswith(f"(job 7): {said}") for ln in lines), lines
    [node] = json.loads(live.cli("cluster", "-o", "json").output)["nodes"]
    assert node["slow_link"]["message"] == said and node["slow_link"]["data"] == {"bw": 1e6}
    assert live.store.mark_slow_link(node_id=A, slow=False, by="job 7", message="healthy")
    assert "slow link" not in live.cli("cluster").output
    [node] = json.loads(live.cli("cluster", "-o", "json").output)["nodes"]
    assert node["slow_link"] is None
    assert [e["kind"] for e in node["events"]] == ["slow_link", "link_ok"]
