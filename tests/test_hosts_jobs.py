"""Jobs across hosts in network namespaces (`tests.hosts`): three hosts of 2 CPUs, each a
`trident node start` node joined to a head on the bridge, and the control plane (`trident up
--ray-address`) on the head's host.

A dp job trains with one rank on each of two hosts (their collectives cross the bridge); a
tp2 x pp2 job puts each tensor-parallel pair inside a host and its pipeline stages on two;
a host powered off mid-step (every process in its namespace killed at once) ends the attempt,
which resumes from the newest checkpoint on the hosts left (the third is the spare), every step
stored once and no more redone than the checkpoint interval.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.conftest import tiny_spec
from tests.hosts import (
    Hosts,
    attempts,
    available,
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


def test_a_dp_job_trains_with_a_rank_on_each_of_two_hosts(on_hosts: tuple[Hosts, Up]) -> None:
    hosts, up = on_hosts
    job_id = submit(up, tiny_spec(
        name="two-hosts", train={"steps": 6, "global_batch": 8, "micro_batch": 2,
                                 "precision": "fp32"},
        resources={"gpus_per_worker": 0, "cpus_per_worker": 1.5}))
    job = finish(up, job_id)
    assert job["state"] == "SUCCEEDED", (job["error"], up.log())
    [attempt] = attempts(up, job_id)
    ranks = attempt["placement"]["ranks"]
    ips = {r["ip"] for r in ranks}
    assert ips <= {h.address for h in hosts.hosts} and len(ips) == 2, ranks
    # Rank 0 serves the rendezvous on its host's address, which the other host reached.
    rank0 = next(r for r in ranks if r["rank"] == 0)
    assert attempt["placement"]["master"].rpartition(":")[0] == rank0["ip"]
    assert [m["step"] for m in steps(up, job_id)] == list(range(1, 7))
    # The bandwidth probe measured the dp group, whose two ranks are on two hosts.
    probe = up.get(f"/jobs/{job_id}/comm")["probe"]
    assert any(row["dim"] == "dp" and sorted(row["group"]) == [0, 1] and row["busbw"] > 0
               for row in probe), probe
    # Each rank's output, the one on the other host too, through the API.
    logs = up.get(f"/jobs/{job_id}/logs")["ranks"]
    assert sorted(c["rank"] for c in logs if c["text"]) == [0, 1], logs
    # The inventory has the hosts by their addresses, alive.
    live = {n["info"].get("address") for n in up.get("/cluster")["nodes"] if n["alive"]}
    assert {h.address for h in hosts.hosts} <= live, live


def test_tp_pairs_stay_inside_a_host_and_pipeline_stages_span_two(
        on_hosts: tuple[Hosts, Up]) -> None:
    hosts, up = on_hosts
    job_id = submit(up, tiny_spec(
        name="tp-pp", parallel={"tp": 2, "pp": 2, "dp": 1, "zero": 0},
        model={"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        train={"steps": 4, "global_batch": 4, "micro_batch": 1, "precision": "fp32"},
        monitor={"probe": False}, resources={"gpus_per_worker": 0, "cpus_per_worker": 1}))
    job = finish(up, job_id)
    assert job["state"] == "SUCCEEDED", (job["error"], up.log())
    [attempt] = attempts(up, job_id)
    ip = {r["rank"]: r["ip"] for r in attempt["placement"]["ranks"]}
    # Ranks 0,1 are stage 0's tensor-parallel pair, 2,3 stage 1's (tp varies fastest).
    assert ip[0] == ip[1] and ip[2] == ip[3] and ip[0] != ip[2], ip
    assert {ip[0], ip[2]} <= {h.address for h in hosts.hosts}
    assert [m["step"] for m in steps(up, job_id)] == list(range(1, 5))


def test_a_host_powered_off_mid_step_resumes_from_the_checkpoint_on_the_spare(
        on_hosts: tuple[Hosts, Up]) -> None:
    hosts, up = on_hosts
    every, total = 3, 60
    job_id = submit(up, tiny_spec(
        # Synchronous saves: a tag is complete when its step's report is, which the bound on
        # what is redone below counts on (in the background a tag lags up to a step).
        name="host-loss", max_retries=2, checkpoint={"every_steps": every, "async": False},
        train={"steps": total, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        monitor={"probe": False},
        # Slower steps in the first attempt: the stacks are asked for before the fault.
        faults=[{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.3}],
        resources={"gpus_per_worker": 0, "cpus_per_worker": 1.5}))
    wait_for("step 5", lambda: any(m["step"] >= 5 for m in steps(up, job_id)), 300, up.log)
    first = attempts(up, job_id)[0]
    victim_ip = next(r["ip"] for r in first["placement"]["ranks"] if r["rank"] == 1)
    victim = next(h for h in hosts.hosts if h.address == victim_ip)
    # Both ranks' stacks, from both hosts, while it trains.
    r = HTTP.post(f"{up.server}/api/v1/jobs/{job_id}/stacks", headers=up.auth, timeout=30)
    assert r.status_code == 202, r.text
    path = f"/jobs/{job_id}/stacks/{r.json()['id']}"
    wait_for("the stacks", lambda: up.get(path)["status"] == "done", 120, up.log)
    result = up.get(path)["result"]
    assert result["ranks"] == 2 and result["missing"] == [], result
    # Rank 0's rendezvous store listens on its host's own address, not on every interface.
    master = first["placement"]["master"]
    rank0_host = next(h for h in hosts.hosts if h.address == master.rpartition(":")[0])
    listening = subprocess.run(["ip", "netns", "exec", rank0_host.netns, "ss", "-Htln"],
                               capture_output=True, text=True, timeout=30, check=True).stdout
    port = master.rpartition(":")[2]
    assert f"{master} " in listening and f"0.0.0.0:{port} " not in listening \
        and f"*:{port} " not in listening, listening
    killed_at = hosts.kill(victim)
    seen = [0]  # the newest step of the first attempt stored, as it goes

    def resumed() -> bool:
        got = steps(up, job_id)
        seen[0] = max([seen[0]] + [m["step"] for m in got if m["attempt"] == 1])
        return any(m["attempt"] >= 2 for m in got)

    wait_for("a step after the host's loss", resumed, 300, up.log)
    first_step_s = time.time() - killed_at
    job = finish(up, job_id)
    assert job["state"] == "SUCCEEDED", (job["error"], up.log())
    tried = attempts(up, job_id)
    assert tried[0]["status"] == "failed", tried[0]
    later = {r["ip"] for a in tried[1:] for r in a["placement"]["ranks"]}
    assert victim_ip not in later and len(later) == 2, (victim_ip, later)
    # Every step stored once, and the resumed attempt began right after a checkpoint no
    # older than one interval before the newest step the first attempt stored.
    by_attempt = stored_once(steps(up, job_id), total)
    resumed_from = by_attempt[2][0] - 1
    assert resumed_from % every == 0 and seen[0] - resumed_from <= every, (
        seen[0], resumed_from)
    assert by_attempt[1][-1] == seen[0]
    assert first_step_s < 60, first_step_s
