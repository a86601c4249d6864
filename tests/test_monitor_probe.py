"""Collective probe over real gloo process groups (4 spawned ranks)."""

import pytest

from service.contract.parallel import ParallelDims
from service.monitor.bandwidth import busbw_factor
from tests._monitor_dist import run_ranks
from workers.monitor.comm_probe import DEFAULT_SIZES, job_sizes, pp_pairs, probe_layout

SIZES = [4 << 10, 256 << 10]


def test_default_sizes_and_pairs():
    assert DEFAULT_SIZES[0] == 1 << 10 and DEFAULT_SIZES[-1] == 64 << 20
    assert all(b == 4 * a for a, b in zip(DEFAULT_SIZES, DEFAULT_SIZES[1:], strict=False))
    assert pp_pairs(ParallelDims(tp=2, pp=3)) == [(0, 2), (2, 4), (1, 3), (3, 5)]


def test_a_jobs_probe_runs_the_largest_size_and_every_other_one_below_it():
    KiB, MiB = 1 << 10, 1 << 20
    assert job_sizes(64 * MiB) == [KiB, 16 * KiB, 256 * KiB, 4 * MiB, 64 * MiB]
    assert job_sizes(100 * MiB) == job_sizes(64 * MiB)
    assert job_sizes(64 * KiB) == [4 * KiB, 64 * KiB]  # the largest is always probed
    assert job_sizes(5000) == [4 * KiB]
    assert job_sizes(KiB) == [KiB]


def _probe_rank(rank, world):
    tp_pp = probe_layout(ParallelDims(tp=2, pp=2), rank, sizes=SIZES, iters=3, warmup=1)
    dp_pp = probe_layout(ParallelDims(dp=2, pp=2), rank, sizes=SIZES,
                         ops=["all_reduce"], iters=3, warmup=1)
    return tp_pp + dp_pp


@pytest.mark.slow
def test_probe_layout_rows(tmp_path):
    rows = [row for per_rank in run_ranks(_probe_rank, 4, tmp_path) for row in per_rank]
    keys = sorted({(r["dim"], tuple(r["group"]), r["op"]) for r in rows})
    assert keys == sorted([
        # ParallelDims(tp=2, pp=2): tp groups [0,1] [2,3], pp pairs (0,2) (1,3)
        *[("tp", g, op) for g in [(0, 1), (2, 3)]
          for op in ["all_reduce", "all_gather", "reduce_scatter"]],
        ("pp", (0, 2), "send_recv"), ("pp", (1, 3), "send_recv"),
        # ParallelDims(dp=2, pp=2): dp groups [0,1] [2,3]
        ("dp", (0, 1), "all_reduce"), ("dp", (2, 3), "all_reduce"),
        # ... and the same pp pairs again
    ])
    assert len(rows) == len(SIZES) * (6 + 2 + 2 + 2)
    for r in rows:
        assert r["bytes"] in SIZES and r["time_s"] > 0 and r["algbw"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_s"])
        assert r["busbw"] == pytest.approx(r["algbw"] * busbw_factor(r["op"], len(r["group"])))
        assert "impl" not in r  # gloo has the single-tensor forms in this torch
    ar = next(r for r in rows if r["op"] == "all_reduce")
    assert ar["busbw"] == pytest.approx(ar["algbw"])  # n=2: 2(n-1)/n = 1
    ag = next(r for r in rows if r["op"] == "all_gather")
    assert ag["busbw"] == pytest.approx(ag["algbw"] / 2)  # n=2: (n-1)/n = 1/2


def test_budgeted_counts():
    from workers.monitor.comm_probe import _budgeted, _iters_for

    # No budget: the full counts, whatever the first call took.
    assert _budgeted(5.0, 64 << 20, 20, 3, None) == (2, _iters_for(64 << 20, 20))
    # A slow point: its first call is the measurement, nothing more.
    assert _budgeted(0.2, 64 << 20, 20, 3, 0.05) == (0, 0)
    # One call more fits: no further warm-up, one timed call.
    assert _budgeted(0.04, 16 << 20, 20, 3, 0.05) == (0, 1)
    # A fast point: warm-up and the full count fit.
    assert _budgeted(1e-5, 4 << 10, 20, 3, 0.05) == (2, 20)
    # In between: what fits.
    assert _budgeted(0.01, 1 << 20, 20, 3, 0.05) == (2, 5)


BIG = 64 << 20


def _budget_rank(rank, world):
    slow = probe_layout(ParallelDims(tp=2, pp=2), rank, sizes=[4 << 10, BIG], point_s=1e-4)
    fast = probe_layout(ParallelDims(tp=2, pp=2), rank, sizes=[4 << 10], point_s=10.0)
    return {"slow": slow, "fast": fast}


@pytest.mark.slow
def test_a_budgeted_probe_times_fewer_calls_on_every_rank_alike(tmp_path):
    """Every rank of a group and both ends of a pair run the same calls (a mismatch would
    hang the spawn); the big points are timed once, the small ones keep their count."""
    got = run_ranks(_budget_rank, 4, tmp_path)
    slow = [r for g in got for r in g["slow"]]
    fast = [r for g in got for r in g["fast"]]
    assert {(r["op"], r["bytes"]) for r in slow} == {
        (op, b) for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
        for b in (4 << 10, BIG)}
    assert all(r["iters"] == 1 for r in slow if r["bytes"] == BIG)
    assert all(r["iters"] == 20 for r in fast)
    assert all(r["time_s"] > 0 for r in slow + fast)


def test_host_pairs_ring_the_first_rank_of_each_host():
    from service.monitor.links import HOST_DIM as JUDGED
    from workers.monitor.comm_probe import HOST_DIM, host_pairs

    assert HOST_DIM == JUDGED  # what the ranks measure is what the controller judges
    assert host_pairs(["a", "a", "b", "b", "c", "c"]) == [(0, 2), (2, 4), (4, 0)]
    assert host_pairs(["b", "a", "b", "a"]) == [(0, 1)]  # two hosts: one pair
    assert host_pairs(["a", "a"]) == [] and host_pairs([]) == []


NODES = ["a", "a", "b", "c"]


def _rounds_rank(rank, world):
    import itertools

    from workers.monitor.probe_rounds import ProbeRounds

    ticks = itertools.count(0, 4)  # each look at the clock: 4 s later
    put = []
    rounds = ProbeRounds(ParallelDims(dp=4), rank, every_s=10, max_bytes=4096,
                         node_id=NODES[rank], put=put.append, clock=lambda: next(ticks))
    probed = [step for step in range(1, 8) if rounds.at_boundary(step, stopping=step == 7)]
    return {"probed": probed, "put": put}


@pytest.mark.slow
def test_probe_rounds_run_on_every_rank_at_the_same_step_boundaries(tmp_path):
    got = run_ranks(_rounds_rank, 4, tmp_path)
    # Rank 0's clock decides: 4 s a look, due from 10 s after the last probe; a rank 0 that
    # is stopping does not probe.
    assert [g["probed"] for g in got] == [[3, 6]] * 4
    for rank, g in enumerate(got):
        assert [(p["kind"], p["rank"], p["round"], p["step"]) for p in g["put"]] == [
            ("probe", rank, 1, 3), ("probe", rank, 2, 6)]
    rows = {rank: {(r["dim"], tuple(r["group"]), r["op"]) for r in g["put"][0]["rows"]}
            for rank, g in enumerate(got)}
    # The DP group's all-reduce (its first rank reports), and the pairs between hosts a
    # (ranks 0, 1), b (2) and c (3), each reported by its sender.
    assert rows == {0: {("dp", (0, 1, 2, 3), "all_reduce"), ("host", (0, 2), "send_recv")},
                    1: set(), 2: {("host", (2, 3), "send_recv")},
                    3: {("host", (3, 0), "send_recv")}}
    assert all(r["bytes"] == 4096 and r["algbw"] > 0 for r in got[3]["put"][1]["rows"])


def _stalled_pair_rank(rank, world, fastest):
    """Ranks 0 -> 1 over 1 MiB, 20 round trips; rank 1 stalls 0.3 s once, mid-measurement,
    as a process of a busy host does when its scheduler runs something else."""
    import time

    import torch.distributed as dist

    from workers.monitor.comm_probe import probe_pair

    recv, calls = dist.recv, [0]

    def stalling_recv(*args, **kwargs):
        calls[0] += 1
        if rank == 1 and calls[0] == 10:
            time.sleep(0.3)
        return recv(*args, **kwargs)

    dist.recv = stalling_recv
    try:
        return probe_pair(0, 1, sizes=[1 << 20], iters=20, warmup=1, dim="host",
                          fastest=fastest)
    finally:
        dist.recv = recv


@pytest.mark.slow
def test_the_links_between_hosts_are_timed_by_their_fastest_round_trip(tmp_path):
    """A moment's stall of one end (a busy host) does not read as a slow link: the host pairs
    take the fastest round trip, where the mean of the same trips is many times slower."""
    (tmp_path / "fastest").mkdir()
    (tmp_path / "mean").mkdir()
    fastest = run_ranks(_stalled_pair_rank, 2, tmp_path / "fastest", True)[0][0]
    mean = run_ranks(_stalled_pair_rank, 2, tmp_path / "mean", False)[0][0]
    # 20 trips of 1 MiB over loopback take well under 0.3 s: the stall dominates the mean.
    assert mean["time_s"] > 0.3 / 20 / 2, mean
    assert fastest["time_s"] < mean["time_s"] / 5, (fastest, mean)
    assert fastest["iters"] == mean["iters"] == 20
