"""Pure unit tests of service.monitor: nccl-tests arithmetic, slow groups, stragglers, hangs,
TP placement warnings and the /comm summary."""

from datetime import UTC, datetime
from typing import Any

import pytest

from service.contract.hardware import get_profile
from service.contract.parallel import Dim, ParallelDims
from service.contract.reports import HeartbeatReport, StepReport
from service.monitor.bandwidth import busbw, busbw_factor, expected_busbw
from service.monitor.comm import summarize_comm
from service.monitor.hang import diagnose_hang
from service.monitor.placement import tp_placement_warnings
from service.monitor.probe import flag_slow_groups, measured_link_bw
from service.monitor.stragglers import compute_s, find_stragglers
from service.store import Metric

CPU = get_profile("cpu")
H100 = get_profile("h100-80gb")


def test_busbw_factors_follow_nccl_tests():
    assert busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert busbw_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert busbw_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert busbw_factor("send_recv", 2) == 1.0
    assert busbw_factor("broadcast", 8) == 1.0
    # 1 GB all-reduce over 4 ranks in 0.1 s: algbw 10 GB/s, busbw 15 GB/s.
    assert busbw("all_reduce", 4, 1e9, 0.1) == pytest.approx(15e9)
    with pytest.raises(ValueError, match="unknown collective"):
        busbw_factor("all_reduce_typo", 2)


def test_expected_busbw_is_latency_bound_small_and_link_bound_large():
    small = expected_busbw("all_reduce", 8, 1024, H100, cross_node=False)
    large = expected_busbw("all_reduce", 8, 1 << 30, H100, cross_node=False)
    inter = expected_busbw("all_reduce", 8, 1 << 30, H100, cross_node=True)
    assert small < 0.01 * H100.intra_node_bw
    assert large == pytest.approx(H100.intra_node_bw, rel=0.02)
    assert inter == pytest.approx(H100.inter_node_bw, rel=0.02)


def _rows(group, busbw_at_64m, dim="dp"):
    return [
        {"dim": dim, "group": group, "op": "all_reduce", "bytes": 1 << 10, "time_s": 1e-3,
         "algbw": 1e6, "busbw": 1e6},  # tiny: latency-bound, never judged
        {"dim": dim, "group": group, "op": "all_reduce", "bytes": 64 << 20, "time_s": 0.1,
         "algbw": busbw_at_64m, "busbw": busbw_at_64m},
    ]


def test_flag_slow_groups_judges_the_largest_size_only():
    rows = _rows([0, 1], 1.4e9) + _rows([2, 3], 0.2e9)
    flags = flag_slow_groups(rows, CPU, threshold=0.5)
    assert [f["group"] for f in flags] == [[2, 3]]
    assert flags[0]["ratio"] == pytest.approx(0.2e9 / flags[0]["expected_busbw"])
    # Placed across nodes the expectation drops to the inter-node link: same CPU numbers here,
    # but on H100 a 30 GB/s group is fine across nodes and slow inside one.
    rows = _rows([0, 1], 30e9)
    assert flag_slow_groups(rows, H100, node_of_rank={0: "a", 1: "a"})
    assert not flag_slow_groups(rows, H100, node_of_rank={0: "a", 1: "b"})
    # all-gather is judged only on request (gloo's is slow by design)
    ag = [dict(r, op="all_gather") for r in _rows([0, 1], 0.1e9)]
    assert flag_slow_groups(ag, CPU) == []
    assert [f["op"] for f in flag_slow_groups(ag, CPU, ops=None)] == ["all_gather"]
    assert not flag_slow_groups(rows, H100, node_of_rank={0: "a", 1: "b"})


def test_straggler_compared_only_with_its_pipeline_stage():
    # pp=2, dp=2: stage 1 (ranks 2, 3) is legitimately slower than stage 0 (ranks 0, 1).
    times = {0: [1.0] * 6, 1: [1.02] * 6, 2: [2.0] * 6, 3: [2.05] * 6}
    stage = {0: 0, 1: 0, 2: 1, 3: 1}
    assert find_stragglers(times, stage, threshold=1.25, min_steps=5) == []
    times[3] = [2.0, 2.0, 3.0, 3.1, 2.9, 3.2, 3.0]  # slow for the last 5 steps
    found = find_stragglers(times, stage, threshold=1.25, min_steps=5,
                            node_of_rank={0: "n0", 1: "n0", 2: "n1", 3: "n1"})
    assert [(s.rank, s.node, s.stage) for s in found] == [(3, "n1", 1)]
    assert found[0].ratio == pytest.approx(3.0 / 2.0)
    assert "rank 3" in found[0].to_event()["message"]


def test_straggler_needs_persistence():
    times = {0: [1.0] * 5, 1: [1.0, 1.0, 1.0, 1.0, 5.0]}  # one slow step is not a straggler
    assert find_stragglers(times, {0: 0, 1: 0}, min_steps=5) == []
    assert find_stragglers({0: [1.0] * 3, 1: [9.0] * 3}, {0: 0, 1: 0}, min_steps=5) == []


def _hb(step, phase, collective=None, dim=None, group=None, t=100.0):
    return {"step": step, "phase": phase, "collective": collective, "dim": dim,
            "group": group, "time": t}


def _beats(hbs):
    """Each rank's heartbeat, as the worker group hands them to the controller."""
    return {r: HeartbeatReport(rank=r, age_s=0.0, **hb) for r, hb in hbs.items()}


def test_hang_names_the_rank_that_never_arrived():
    dims = ParallelDims(tp=2, dp=2)  # tp groups [0,1] [2,3]; dp groups [0,2] [1,3]
    hbs = _beats({
        0: _hb(7, "backward", "all_reduce", "dp", [0, 2]),
        1: _hb(7, "backward", "all_reduce", "dp", [1, 3]),
        2: _hb(7, "forward", t=95.0),  # stuck in compute at step 7
        3: _hb(7, "backward", "all_reduce", "dp", [1, 3]),
    })
    assert diagnose_hang(hbs, now=105.0, timeout=10.0, dims=dims) is None
    d = diagnose_hang(hbs, now=111.0, timeout=10.0, dims=dims)
    assert d is not None
    assert d.never_arrived == [2]
    assert d.stalled_s == pytest.approx(11.0)
    [w] = d.waiting
    assert (w.dim, w.group, w.collective, w.waiting, w.missing) == (
        "dp", [0, 2], "all_reduce", [0], [2])
    assert "rank 2 never arrived" in d.summary and "forward" in d.summary


def test_hang_follows_chain_and_flags_silent_ranks():
    dims = ParallelDims(tp=2, pp=2)  # tp [0,1] [2,3]; pp pairs [0,2] [1,3]
    hbs = _beats({
        0: _hb(3, "forward", "all_reduce", "tp", [0, 1]),
        1: _hb(3, "forward", "send", "pp", [1, 3]),  # blocked on rank 3, so not the culprit
        2: _hb(3, "forward", "recv", "pp", [0, 2]),
    })
    d = diagnose_hang(hbs, now=200.0, timeout=30.0, dims=dims)
    assert d is not None
    assert d.never_arrived == [3]  # no heartbeat at all
    waits = {(w.collective, tuple(w.group)): w.missing for w in d.waiting}
    assert waits[("all_reduce", (0, 1))] == [1]
    assert waits[("send", (1, 3))] == [3]
    assert waits[("recv", (0, 2))] == [0]


def test_hang_with_matched_p2p_is_not_a_missing_peer():
    hbs = _beats({0: _hb(1, "forward", "send", "pp", [0, 1]),
                  1: _hb(1, "forward", "recv", "pp", [0, 1])})
    d = diagnose_hang(hbs, now=500.0, timeout=30.0)
    assert d is not None and d.waiting == [] and d.never_arrived == []
    assert "stuck inside the transport" in d.summary


def test_hang_all_in_compute_names_the_laggard():
    hbs = _beats({0: _hb(5, "optimizer"), 1: _hb(4, "forward")})
    d = diagnose_hang(hbs, now=500.0, timeout=30.0)
    assert d is not None and d.never_arrived == [1]


def test_tp_placement_warnings():
    node = {0: "a", 1: "a", 2: "a", 3: "b"}
    gpu = {0: 0, 1: 1, 2: 2, 3: 0}
    inv = {"a": {"topology": {"GPU0": {"GPU1": "NV12", "GPU2": "SYS"},
                              "GPU1": {"GPU0": "NV12", "GPU2": "PIX"}}}}
    assert tp_placement_warnings([[0, 1]], node, gpu, inv) == []
    [w] = tp_placement_warnings([[0, 1, 2]], node, gpu, inv)
    assert "GPU0-GPU2 SYS" in w and "GPU1-GPU2 PIX" in w
    [w] = tp_placement_warnings([[2, 3]], node, gpu, inv)
    assert "spans nodes ['a', 'b']" in w
    assert tp_placement_warnings([[0, 1]], node) == []  # CPU node: no link matrix


def _stored(step: int, step_time_s: float, comm: dict[str, Any], *, rank: int = 0,
            timed: bool = True) -> Metric:
    """A stored step as the store reads it back (`service.store.views.Metric`)."""
    return Metric(attempt=0, step=step, rank=rank, loss=None, step_time_s=step_time_s,
                  tokens_per_s=0.0, data={"comm": comm, "timed": timed},
                  time=datetime.now(UTC))


def test_summarize_comm_per_dimension_with_prediction():
    dims = ParallelDims(tp=2, dp=2)
    comm = {"tp": {"all_reduce": {"time_s": 0.1, "bytes": 1_000_000, "calls": 4}},
            "dp": {"reduce_scatter": {"time_s": 0.2, "bytes": 4_000_000, "calls": 1},
                   "all_gather": {"time_s": 0.1, "bytes": 4_000_000, "calls": 1}}}
    reports = {r: [_stored(s, 1.0, comm, rank=r) for s in range(3)] for r in range(4)}
    predicted = {"step_s": 0.8, "tp_comm_s": 0.08, "pp_comm_s": 0.0, "dp_comm_s": 0.4}
    out = summarize_comm(reports, dims, predicted, probe=[{"dim": "tp"}])
    tp, dp = out["dims"]["tp"], out["dims"]["dp"]
    assert tp["time_s_per_step"] == pytest.approx(0.1)
    assert tp["fraction"] == pytest.approx(0.1)
    assert tp["bytes_per_step"] == 1_000_000
    assert tp["busbw"] == pytest.approx(1_000_000 * 1.0 / 0.1)  # all-reduce n=2: factor 1
    assert dp["time_s_per_step"] == pytest.approx(0.3)
    assert dp["busbw"] == pytest.approx(8_000_000 * 0.5 / 0.3)  # rs/ag n=2: factor 1/2
    assert dp["predicted_fraction"] == pytest.approx(0.5)
    assert out["dims"]["pp"]["time_s_per_step"] == 0.0
    assert out["dims"]["pp"]["predicted_time_s_per_step"] == 0.0
    assert len(out["ranks"]) == 4 and out["ranks"][0]["dims"]["dp"]["ops"]["all_gather"][
        "calls"] == 1
    assert out["probe"] == [{"dim": "tp"}]
    assert Dim.TP.value in out["dims"]


def test_summarize_comm_untimed_steps_count_bytes_not_time():
    s = {"tp": {"all_reduce": {"time_s": 0.5, "bytes": 100, "calls": 1}}}
    untimed = {"tp": {"all_reduce": {"time_s": 0.0, "bytes": 100, "calls": 1}}}
    reports = {0: [_stored(0, 1.0, s), _stored(1, 1.0, untimed, timed=False)]}
    out = summarize_comm(reports, {"tp": 2})
    assert out["dims"]["tp"]["time_s_per_step"] == pytest.approx(0.5)
    assert out["dims"]["tp"]["bytes_per_step"] == 100


def test_measured_link_bw_splits_intra_and_inter_node():
    # trident probe layout: tp=2 per node (groups [0,1] [2,3]), dp across nodes ([0,2] [1,3])
    rows = (_rows([0, 1], 40e9, "tp") + _rows([2, 3], 60e9, "tp")
            + _rows([0, 2], 10e9) + _rows([1, 3], 12e9))
    bw = measured_link_bw(rows, {0: "a", 1: "a", 2: "b", 3: "b"})
    assert bw == {"intra_node_bw": pytest.approx(50e9), "inter_node_bw": pytest.approx(11e9)}


def test_compute_s_subtracts_timed_comm():
    comm = {"tp": {"all_reduce": {"time_s": 0.2, "bytes": 1, "calls": 1}},
            "dp": {"all_gather": {"time_s": 0.3, "bytes": 1, "calls": 1}}}
    report = StepReport(rank=0, step=1, step_time_s=1.0, tokens_per_s=1.0, comm=comm)
    assert compute_s(report) == pytest.approx(0.5)
    assert compute_s(report.model_copy(update={"timed": False})) is None
    assert compute_s(report.model_copy(update={"comm": None})) is None
