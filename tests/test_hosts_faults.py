"""Faults of hosts in network namespaces (`tests.hosts`), with `trident up --ray-address` on
the head's host: a host cut off (its link down) for longer than the head's health checks
allow, then back; a host lost with no spare, for a job that waits and for an elastic one that
re-plans onto the hosts left; a host drained for maintenance. Each asserts the steps stored,
not only how the job ended.
"""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from tests.hosts import (
    Hosts,
    attempts,
    available,
    dp_job,
    finish,
    steps,
    stored_once,
    submit,
)
from tests.servers import HTTP
from tests.up import Up
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(available() is not None, reason=str(available()))]

EVERY, TOTAL = 3, 60


def alive_at(up: Up, address: str) -> bool:
    """Whether the control plane's inventory has a live node at `address`."""
    return any(n["alive"] and n["info"].get("address") == address
               for n in up.get("/cluster")["nodes"])


def test_a_host_cut_off_is_left_behind_and_rejoins_by_itself_once_its_link_is_back(
        on_hosts: tuple[Hosts, Up]) -> None:
    hosts, up = on_hosts
    job_id = submit(up, dp_job("partition", 2, steps=TOTAL, every=EVERY))
    wait_for("step 5", lambda: any(m["step"] >= 5 for m in steps(up, job_id)), 300, up.log)
    first = attempts(up, job_id)[0]
    cut_ip = next(r["ip"] for r in first["placement"]["ranks"] if r["rank"] == 1)
    cut = next(h for h in hosts.hosts if h.address == cut_ip)
    hosts.partition(cut)
    wait_for("a step after the partition", lambda: any(
        m["attempt"] >= 2 for m in steps(up, job_id)), 300, up.log)
    failed = attempts(up, job_id)[0]
    assert failed["status"] == "failed" and failed["ended_at"], failed
    hosts.heal(cut)
    job = finish(up, job_id)
    assert job["state"] == "SUCCEEDED", (job["error"], up.log())
    by_attempt = stored_once(steps(up, job_id), TOTAL)
    later = {r["ip"] for a in attempts(up, job_id)[1:] for r in a["placement"]["ranks"]}
    assert cut_ip not in later, later
    # The cut-off rank never wrote into the job: attempt 1 has no step from after it ended,
    # its link back up included, and its steps end within an interval of the checkpoint
    # the new attempt resumed from.
    ended = datetime.fromisoformat(failed["ended_at"])
    assert all(datetime.fromisoformat(m["time"]) <= ended
               for m in steps(up, job_id, attempt=1)), (ended, steps(up, job_id, attempt=1))
    assert by_attempt[1][-1] - (by_attempt[2][0] - 1) <= EVERY, by_attempt
    # Back on the network, the host is a node of the cluster again, nobody having asked.
    wait_for("the cut-off host back in the cluster", lambda: alive_at(up, cut_ip), 120,
             up.log)


def test_a_host_lost_with_no_spare_waits_queued_until_a_host_comes_back(
        on_hosts: tuple[Hosts, Up]) -> None:
    hosts, up = on_hosts
    job_id = submit(up, dp_job("no-spare", 3, steps=TOTAL, every=EVERY))
    wait_for("step 5", lambda: any(m["step"] >= 5 for m in steps(up, job_id)), 300, up.log)
    victim = next(h for h in hosts.hosts if h.address == next(
        r["ip"] for r in attempts(up, job_id)[0]["placement"]["ranks"] if r["rank"] == 2))
    hosts.kill(victim)
    wait_for("QUEUED", lambda: up.get(f"/jobs/{job_id}")["state"] == "QUEUED", 300, up.log)
    events = up.get(f"/jobs/{job_id}/events", limit=1000)["items"]
    queued = [e for e in events if e["kind"] == "state" and e["data"].get("to") == "QUEUED"]
    assert "no longer has room" in queued[-1]["message"], queued
    time.sleep(5)  # it waits: not failed as impossible
    assert up.get(f"/jobs/{job_id}")["state"] == "QUEUED"
    hosts.start_node(victim)  # the host powers on again and joins
    job = finish(up, job_id)
    assert job["state"] == "SUCCEEDED", (job["error"], up.log())
    by_attempt = stored_once(steps(up, job_id), TOTAL)
    assert sorted(by_attempt) == [1, 2] and (by_attempt[2][0] - 1) % EVERY == 0


def test_an_elastic_job_that_loses_a_host_with_no_spare_re_plans_onto_the_hosts_left(
        on_hosts: tuple[Hosts, Up]) -> None:
    hosts, up = on_hosts
    job_id = submit(up, dp_job("elastic", 3, steps=TOTAL, every=EVERY,
                               elastic={"min_ranks": 2, "wait_s": 3}))
    wait_for("step 5", lambda: any(m["step"] >= 5 for m in steps(up, job_id)), 300, up.log)
    victim = next(h for h in hosts.hosts if h.address == next(
        r["ip"] for r in attempts(up, job_id)[0]["placement"]["ranks"] if r["rank"] == 2))
    hosts.kill(victim)
    job = finish(up, job_id)
    assert job["state"] == "SUCCEEDED", (job["error"], up.log())
    assert job["world_size"] == 2, job
    events = up.get(f"/jobs/{job_id}/events", limit=1000)["items"]
    elastic = [e for e in events if e["kind"] == "elastic"]
    # One move down; the only other elastic events are the notes of a pass that found the
    # lost ranks' room not yet given back (no layout fitted then), each said once.
    [down] = [e for e in elastic if e["data"].get("direction") == "down"]
    assert down["data"]["to"]["world_size"] == 2, down
    assert all(e["data"].get("direction") is None for e in elastic if e is not down), elastic
    by_attempt = stored_once(steps(up, job_id), TOTAL)
    later = {r["ip"] for a in attempts(up, job_id)[1:] for r in a["placement"]["ranks"]}
    assert victim.address not in later and len(later) == 2, later
    assert (by_attempt[2][0] - 1) % EVERY == 0


def test_a_drained_host_loses_no_step_and_gets_no_ranks_until_uncordoned(
        on_hosts: tuple[Hosts, Up]) -> None:
    hosts, up = on_hosts
    job_id = submit(up, dp_job("drain", 2, steps=TOTAL, every=EVERY))
    wait_for("step 5", lambda: any(m["step"] >= 5 for m in steps(up, job_id)), 300, up.log)
    drained_ip = next(r["ip"] for r in attempts(up, job_id)[0]["placement"]["ranks"]
                      if r["rank"] == 1)
    r = HTTP.post(f"{up.server}/api/v1/nodes/{drained_ip}/drain", headers=up.auth,
                  json={"reason": "maintenance", "grace_s": 60}, timeout=30)
    assert r.status_code == 200, r.text
    job = finish(up, job_id)
    assert job["state"] == "SUCCEEDED", (job["error"], up.log())
    tried = attempts(up, job_id)
    assert [a["status"] for a in tried] == ["preempted", "succeeded"], tried
    later = {r["ip"] for r in tried[1]["placement"]["ranks"]}
    assert drained_ip not in later and len(later) == 2, later
    # No step lost nor redone: the first attempt saved at the step it stopped after, and
    # the second began at the next one.
    by_attempt = stored_once(steps(up, job_id), TOTAL)
    assert by_attempt[2][0] == by_attempt[1][-1] + 1, by_attempt
    nodes = [n for n in up.get("/cluster")["nodes"] if n["info"].get("address") == drained_ip]
    assert [n["state"] for n in nodes if n["alive"]] == ["drained"], nodes
    r = HTTP.post(f"{up.server}/api/v1/nodes/{drained_ip}/uncordon", headers=up.auth,
                  timeout=30)
    assert r.status_code == 200, r.text
