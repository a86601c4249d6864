"""The slow-link rule (`service.monitor.links`) on made-up probe rows: which host is named
from its pairs' bandwidth, with two, three and four hosts; and what an attempt's health makes
of probe rounds in the store: the job's `slow_link` event, the node's mark, its clearing."""

from __future__ import annotations

from typing import Any

import pytest

from client.payloads import Event, Node
from service.contract.reports import ProbeReport, StepReport
from service.monitor.attempt import AttemptHealth
from service.monitor.links import comm_s_by_host, host_pair_bw, judge_links, slow_link_message
from service.store import Store
from tests.fakes import step_report, submit

MiB = 1 << 20


def pair(src: int, dst: int, bw: float, nbytes: int = MiB, dim: str = "host") -> dict[str, Any]:
    return {"dim": dim, "group": [src, dst], "op": "send_recv", "bytes": nbytes,
            "time_s": nbytes / bw, "algbw": bw, "busbw": bw}


def ring(bw: dict[tuple[int, int], float]) -> list[dict[str, Any]]:
    """A probe's host rows: one per pair, plus a small size that must not be judged."""
    rows = [pair(a, b, x) for (a, b), x in bw.items()]
    rows += [pair(a, b, 1e3, nbytes=4096) for a, b in bw]  # latency-bound: ignored
    return rows


ONE_RANK_A_HOST = {0: "node-a", 1: "node-b", 2: "node-c", 3: "node-d"}


def test_three_hosts_name_the_one_common_to_the_slow_pairs() -> None:
    rows = ring({(0, 1): 900e6, (1, 2): 1.1e6, (2, 0): 1.0e6})
    v = judge_links(rows, ONE_RANK_A_HOST, threshold=0.5)
    assert [s.node_id for s in v.slow] == ["node-c"]
    [c] = v.slow
    assert c.bw == 1.05e6 and c.reference_bw == 900e6 and c.ratio < 0.01
    assert sorted(p["peer"] for p in c.pairs) == ["node-a", "node-b"]
    assert v.healthy == ["node-a", "node-b"]
    message = slow_link_message(c, "10.0.0.13")
    assert "10.0.0.13" in message and "node-c" in message and "1.05 MB/s" in message


def test_healthy_links_of_uneven_speed_name_nobody() -> None:
    rows = ring({(0, 1): 900e6, (1, 2): 600e6, (2, 0): 700e6})
    v = judge_links(rows, ONE_RANK_A_HOST, threshold=0.5)
    assert v.slow == [] and v.healthy == ["node-a", "node-b", "node-c"]


def test_one_slow_pair_of_three_hosts_names_no_host() -> None:
    """One slow pair among healthy ones: neither end has all its links slow (a bad cable
    between two hosts, not a host); nobody is named."""
    rows = ring({(0, 1): 900e6, (1, 2): 1e6, (2, 0): 800e6})
    assert judge_links(rows, ONE_RANK_A_HOST).slow == []


def test_four_hosts_in_a_ring_and_several_ranks_a_host() -> None:
    # Two ranks a host; the ring's pairs go from each host's first rank to the next's.
    nodes = {r: f"node-{'abcd'[r // 2]}" for r in range(8)}
    rows = ring({(0, 2): 1e9, (2, 4): 2e6, (4, 6): 3e6, (6, 0): 1.2e9})
    rows.append({"dim": "dp", "group": [0, 2, 4, 6], "op": "all_reduce", "bytes": MiB,
                 "time_s": 1.0, "algbw": 1e6, "busbw": 1.5e6})  # another dim: not a pair
    v = judge_links(rows, nodes)
    assert [s.node_id for s in v.slow] == ["node-c"]
    assert v.slow[0].reference_bw == 1.1e9


def test_two_hosts_are_judged_against_the_profile_and_both_ends_named() -> None:
    nodes = {0: "node-a", 1: "node-b"}
    sizes: list[int] = []

    def expected(nbytes: int) -> float:  # the profile's, at the size judged
        sizes.append(nbytes)
        return 1e9

    slow = judge_links([pair(0, 1, 1e6), pair(0, 1, 1e3, nbytes=4096)], nodes,
                       expected_bw=expected)
    assert sizes == [MiB]
    assert [(s.node_id, s.either_end) for s in slow.slow] == [("node-a", True),
                                                              ("node-b", True)]
    assert "or its one peer" in slow_link_message(slow.slow[0], "10.0.0.11")
    fine = judge_links([pair(0, 1, 0.9e9)], nodes, expected_bw=expected)
    assert fine.slow == [] and fine.healthy == ["node-a", "node-b"]
    # Without a profile's figure, one pair says nothing.
    assert judge_links([pair(0, 1, 1e6)], nodes).slow == []


def test_pairs_probed_only_below_a_mebibyte_are_not_judged() -> None:
    """Latency-bound sizes (a job's small `monitor.probe_max_bytes`) judge nothing: the
    slowest pair there may be noise."""
    rows = [pair(a, b, x, nbytes=64 << 10)
            for (a, b), x in {(0, 1): 900e6, (1, 2): 1e6, (2, 0): 1e6}.items()]
    v = judge_links(rows, ONE_RANK_A_HOST)
    assert v.slow == [] and v.healthy == [] and v.pairs == {}
    assert judge_links(rows, ONE_RANK_A_HOST, min_bytes=64 << 10).slow[0].node_id == "node-c"


def test_pairs_inside_one_host_and_ranks_without_a_placement_are_left_out() -> None:
    nodes = {0: "node-a", 1: "node-a", 2: "node-b"}
    got = host_pair_bw([pair(0, 1, 1e3), pair(1, 2, 5e8), pair(2, 7, 1.0)], nodes)
    assert got == {("node-a", "node-b"): (5e8, [1, 2], MiB)}
    assert judge_links([], nodes).slow == []


def test_the_ranks_collective_times_by_host() -> None:
    nodes = {0: "node-a", 1: "node-b", 2: "node-c"}
    got = comm_s_by_host({0: [0.1, 0.2], 1: [0.3], 2: [2.0, 2.2, 2.4]}, nodes, "node-c")
    assert got == {"host_comm_s": 2.2, "others_comm_s": 0.2}
    assert comm_s_by_host({}, nodes, "node-c") == {"host_comm_s": None, "others_comm_s": None}


# --- the attempt's health: the job's events and the node's mark, in the store ---------------

def test_a_probe_round_names_the_slow_host_on_the_job_and_the_node_until_healthy_again(
        sqlite_store: Store) -> None:
    job = sqlite_store.get_job(job_id=submit(sqlite_store, parallel={"tp": 1, "pp": 1, "dp": 3},
                                             train={"steps": 6, "global_batch": 12,
                                                    "micro_batch": 2, "precision": "fp32"}))
    sqlite_store.upsert_nodes(nodes=[
        {"node_id": n, "hostname": f"h{i}", "address": f"10.0.0.{11 + i}"}
        for i, n in enumerate(("node-a", "node-b", "node-c"))])
    health = AttemptHealth(sqlite_store, job, 1, job.spec)
    health.placed({"ranks": [{"rank": r, "node_id": ONE_RANK_A_HOST[r]} for r in range(3)]})
    for r in range(3):  # rank 2's collectives took longer: in the event's evidence
        health.step_report(StepReport.model_validate({
            **step_report(r, 1, 2.0), "step_time_s": 3.0, "timed": True,
            "comm": {"dp": {"all_reduce": {"time_s": 0.4 + r, "bytes": 1e6, "calls": 1}}}}))

    def round_(n: int, slow_c: bool) -> None:
        bw = {(0, 1): 900e6, (1, 2): 1e6 if slow_c else 800e6, (2, 0): 1e6 if slow_c else 850e6}
        for r in range(3):  # each pair's sender reports it
            mine = [row for row in ring(bw) if row["group"][0] == r]
            health.probe_report(ProbeReport(kind="probe", rank=r, round=n, step=4 * n,
                                            rows=mine))  # type: ignore[arg-type]

    def events(kind: str) -> list[Event]:
        return [e for e in sqlite_store.list_events(job_id=job.id) if e.kind == kind]

    def node_c() -> Node:
        return next(n for n in sqlite_store.list_nodes() if n.node_id == "node-c")

    round_(0, slow_c=False)
    assert events("slow_link") == [] and node_c().slow_link is None
    assert [e.kind for e in events("probe")] == ["probe"]
    round_(1, slow_c=True)
    round_(2, slow_c=True)  # still slow: named once
    [named] = events("slow_link")
    assert "10.0.0.13" in named.message and named.data["node_id"] == "node-c"
    assert named.data["step"] == 4 and named.data["ratio"] < 0.01
    assert named.data["host_comm_s"] == pytest.approx(2.4)
    assert named.data["others_comm_s"] == pytest.approx(0.9)
    assert node_c().slow_link is not None and node_c().slow_link.data["job_id"] == job.id
    assert all(n.slow_link is None for n in sqlite_store.list_nodes() if n.node_id != "node-c")
    probes = sqlite_store.list_probes(job_id=job.id)
    assert [p.summary["round"] for p in probes] == [2, 1, 0]
    assert probes[0].summary["slow_hosts"] == ["node-c"]
    assert len(events("probe")) == 1  # a round during training adds no probe event
    round_(3, slow_c=False)
    [ok] = events("link_ok")
    assert "10.0.0.13" in ok.message and node_c().slow_link is None
    assert [e.kind for e in node_c().events] == ["slow_link", "link_ok"]


def test_the_probe_interval_is_bounded_in_the_spec() -> None:
    from pydantic import ValidationError

    from service.contract.spec import MonitorSpec

    assert MonitorSpec().probe_every_s == 600
    assert MonitorSpec(probe_every_s=0).probe_every_s == 0
    for bad in (1, -1, 86401):
        with pytest.raises(ValidationError, match="probe_every_s"):
            MonitorSpec(probe_every_s=bad)
