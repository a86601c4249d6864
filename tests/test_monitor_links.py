"""The slow-link rule (`service.monitor.links`) on made-up probe rows: which host is named
from its pairs' bandwidth, with two, three and four hosts, and what clears it."""

from __future__ import annotations

from typing import Any

from service.monitor.links import comm_s_by_host, host_pair_bw, judge_links, slow_link_message

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
    slow = judge_links([pair(0, 1, 1e6)], nodes, expected_bw=1e9)
    assert [(s.node_id, s.either_end) for s in slow.slow] == [("node-a", True),
                                                              ("node-b", True)]
    assert "or its one peer" in slow_link_message(slow.slow[0], "10.0.0.11")
    fine = judge_links([pair(0, 1, 0.9e9)], nodes, expected_bw=1e9)
    assert fine.slow == [] and fine.healthy == ["node-a", "node-b"]
    # Without a profile's figure, one pair says nothing.
    assert judge_links([pair(0, 1, 1e6)], nodes).slow == []


def test_pairs_inside_one_host_and_ranks_without_a_placement_are_left_out() -> None:
    nodes = {0: "node-a", 1: "node-a", 2: "node-b"}
    got = host_pair_bw([pair(0, 1, 1e3), pair(1, 2, 5e8), pair(2, 7, 1.0)], nodes)
    assert got == {("node-a", "node-b"): (5e8, [1, 2])}
    assert judge_links([], nodes).slow == []


def test_the_ranks_collective_times_by_host() -> None:
    nodes = {0: "node-a", 1: "node-b", 2: "node-c"}
    got = comm_s_by_host({0: [0.1, 0.2], 1: [0.3], 2: [2.0, 2.2, 2.4]}, nodes, "node-c")
    assert got == {"host_comm_s": 2.2, "others_comm_s": 0.2}
    assert comm_s_by_host({}, nodes, "node-c") == {"host_comm_s": None, "others_comm_s": None}
