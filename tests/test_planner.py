"""Planner behaviour: plan JSON, stages, links, offload, search, plan_job, capacity, calibration.

Pure and fast (milliseconds each): no torch, no DeepSpeed.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from service.contract.hardware import GB, PROFILES, get_profile
from service.contract.spec import JobSpec, ParallelSpec
from service.planner import PlanInfeasible, evaluate, plan_job, search
from service.planner.calibrate import fit_overheads, profile_from_measurements
from service.planner.capacity import can_train, capacity
from service.planner.explain import tuning_notes
from service.planner.report import plan_command, render_can_train, render_plan, render_search
from service.planner.shape import ModelShape
from service.planner.stored import plan_json
from service.planner.timing import elementwise_bytes, group_link, ring_time


def job(preset: str = "gpt3-1.3b", *, gpu: str = "a100-80gb", nodes: int = 1, gpn: int = 8,
        parallel: ParallelSpec | str = "auto", gb: int = 64, mb: int = 1,
        precision: str = "bf16") -> JobSpec:
    return JobSpec(name="t", model={"preset": preset},
                   train={"global_batch": gb, "micro_batch": mb, "precision": precision},
                   parallel=parallel, cluster={"gpu": gpu, "nodes": nodes,
                                               "gpus_per_node": gpn})


def tiny_cpu(zero: int = 2, precision: str = "fp32") -> JobSpec:
    return JobSpec(name="tiny", model={"preset": "gpt-tiny"},
                   train={"global_batch": 8, "micro_batch": 2, "precision": precision},
                   parallel=ParallelSpec(dp=2, zero=zero),
                   cluster={"gpu": "cpu", "nodes": 1, "gpus_per_node": 2})


def test_profiles_complete() -> None:
    for name in ("v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu"):
        p = get_profile(name)
        assert p.peak_flops_bf16 > 0 and p.memory_bytes > 0 and p.inter_node_bw > 0
        assert p.source
    assert PROFILES["h100-80gb"].peak_flops_bf16 > 3 * PROFILES["a100-80gb"].peak_flops_bf16
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'"):
        get_profile("tpu")


def test_plan_json_documented_keys() -> None:
    spec = job(parallel=ParallelSpec(tp=2, pp=2, dp=2, zero=1), gb=16)
    out = plan_json(evaluate(spec))
    assert set(out["layout"]) == set(ParallelSpec.model_fields) | {"micro_batch"}
    for key in ("params", "grads", "optimizer", "activations", "other", "total"):
        assert out["memory"][key] >= 0
    mem = out["memory"]
    assert mem["total"] == pytest.approx(mem["params"] + mem["grads"] + mem["optimizer"]
                                         + mem["activations"] + mem["other"])
    for key in ("step_s", "compute_s", "bubble_s", "tp_comm_s", "pp_comm_s", "dp_comm_s"):
        assert out["time"][key] >= 0
    for key in ("fits", "reasons", "tokens_per_s", "mfu", "tflops_per_gpu", "world_size",
                "rank_layout", "host_memory", "shares", "explanation", "notes", "profile"):
        assert key in out
    assert len(out["rank_layout"]) == 8 and out["world_size"] == 8
    stages = out["memory_by_stage"]
    assert [s["stage"] for s in stages] == [0, 1]
    assert max(s["total"] for s in stages) == pytest.approx(mem["total"])
    assert out["tokens_per_s"] == pytest.approx(16 * 2048 / out["time"]["step_s"])


def test_tiny_cpu_job_fits() -> None:
    for precision in ("fp32", "bf16"):
        plan = evaluate(tiny_cpu(precision=precision))
        assert plan.fits, plan.reasons
        stored = plan_job(tiny_cpu(precision=precision))
        assert stored["fits"] and stored["layout"]["zero"] == 2


def test_first_and_last_stage_carry_embedding_and_head() -> None:
    from service.planner.memory import stage_memory
    plan = evaluate(job("llama3-8b", parallel=ParallelSpec(pp=4, dp=2), gb=8))
    sc = plan.scenario
    first, mid, last = (stage_memory(sc, s) for s in (0, 1, 3))
    emb = sc.shape.vocab * sc.shape.hidden
    assert first.params_per_rank - mid.params_per_rank == pytest.approx(emb, rel=0.001)
    assert last.params_per_rank - mid.params_per_rank == pytest.approx(emb, rel=0.001)
    assert last.logits > 0 and first.logits == 0 and mid.logits == 0
    # 1F1B: the first stage keeps pp micro-batches in flight, the last one.
    assert first.in_flight == 4 and last.in_flight == 1


def test_a_group_with_several_ranks_per_node_crosses_nodes_on_each_of_their_nics() -> None:
    """NCCL's rings leave a node through the NIC next to the GPU they exit from: ZeRO-3 over
    two whole nodes gathers on 8 NICs per node, over 16 one-GPU nodes on one."""
    prof = get_profile("a100-80gb")
    lay = ParallelSpec(dp=16, zero=3)
    rails = evaluate(job("gpt3-1.3b", nodes=2, gpn=8, gb=64, mb=4), lay)
    single = evaluate(job("gpt3-1.3b", nodes=16, gpn=1, gb=64, mb=4), lay)
    assert group_link(rails.scenario, 1, 16) == (min(prof.intra_node_bw,
                                                     8 * prof.inter_node_bw),
                                                 prof.inter_node_latency_s, True)
    assert group_link(rails.scenario, 8, 2)[0] == prof.inter_node_bw  # one rank per node
    assert group_link(rails.scenario, 1, 8)[0] == prof.intra_node_bw  # inside a node
    # Gigabyte gathers: bandwidth, not latency, sets the ratio.
    assert single.time.zero3_gather_s / rails.time.zero3_gather_s == pytest.approx(
        min(prof.intra_node_bw, 8 * prof.inter_node_bw) / prof.inter_node_bw, rel=0.02)


def test_element_wise_work_is_bytes_at_hbm_bandwidth_and_weighs_most_on_narrow_models() -> None:
    lay = ParallelSpec(dp=8)
    narrow = evaluate(job("gpt3-1.3b", gb=64, mb=4), lay)
    wide = evaluate(job("gpt3-13b", gb=64, mb=4), lay)
    sc, t = narrow.scenario, narrow.time
    assert t.elementwise_s == pytest.approx(sc.micro_batches * sc.shape.layers
                                            * elementwise_bytes(sc, 4) / sc.profile.hbm_bw)
    assert t.elementwise_s / t.step_s > wide.time.elementwise_s / wide.time.step_s > 0
    # H100's FLOP/s grow 3.2x over A100's, its HBM bandwidth 1.6x: a larger share there.
    h100 = evaluate(job("gpt3-1.3b", gpu="h100-80gb", gb=64, mb=4), lay)
    assert h100.time.elementwise_s / h100.time.step_s > t.elementwise_s / t.step_s
    # On `cpu` the per-layer overhead, fitted to measured steps, holds it.
    assert evaluate(tiny_cpu()).time.elementwise_s == 0


def test_tp_across_nodes_pays_inter_node_link() -> None:
    prof = get_profile("a100-80gb")
    lay = ParallelSpec(tp=4, dp=4)
    # Micro-batch 8: messages of 168 MB, so latency is negligible against bandwidth.
    inside = evaluate(job("gpt3-13b", nodes=2, gpn=8, gb=64, mb=8), lay)  # within a node
    across = evaluate(job("gpt3-13b", nodes=8, gpn=2, gb=64, mb=8), lay)  # over 2 nodes
    # Two of the group's ranks on each node: NCCL's rings cross nodes on both their NICs.
    assert across.time.tp_comm_s / inside.time.tp_comm_s == pytest.approx(
        prof.intra_node_bw / (2 * prof.inter_node_bw), rel=0.05)
    assert any("inter-node" in n for n in tuning_notes(across))
    assert not any("inter-node" in n for n in tuning_notes(inside))


def test_ring_costs_match_nccl_tests_busbw() -> None:
    S, n, bw = 1e9, 8, 100e9
    # nccl-tests: busbw = algbw * 2(n-1)/n for all-reduce, (n-1)/n for all-gather.
    assert S / ring_time("all_reduce", S, n, bw, 0.0) * 2 * (n - 1) / n == pytest.approx(bw)
    assert S / ring_time("all_gather", S, n, bw, 0.0) * (n - 1) / n == pytest.approx(bw)
    assert ring_time("all_reduce", S, 1, bw, 1e-5) == 0


def test_offload_moves_optimizer_to_host_and_host_is_checked() -> None:
    spec = job("gpt3-13b", gb=8)
    on = evaluate(spec, ParallelSpec(dp=8, zero=2))
    off = evaluate(spec, ParallelSpec(dp=8, zero=2, offload="optimizer"))
    assert off.memory.optimizer == 0 and on.memory.optimizer > 0
    assert off.memory.host_per_rank >= on.memory.optimizer  # plus gradients and buffers
    assert off.time.optimizer_s > on.time.optimizer_s and off.time.offload_s > 0
    small_host = get_profile("a100-80gb").with_(host_memory_bytes=64 * GB)
    tight = evaluate(spec, ParallelSpec(dp=8, zero=2, offload="optimizer"), profile=small_host)
    assert not tight.fits and any("host memory" in r for r in tight.reasons)


def test_a_save_in_the_background_holds_a_host_copy_of_what_the_rank_writes() -> None:
    """`checkpoint.async` (saves due): each rank's optimizer states and, below ZeRO-3, the
    weights its DP group's first rank writes, in host memory while the save is in flight;
    a synchronous save or none holds nothing (the copy against the tag's files on real ranks:
    tests/test_checkpoint_async.py)."""
    base = job("gpt3-13b", gb=8)

    def planned(zero: int, **checkpoint: object) -> Any:
        spec = base.model_copy(update={"checkpoint": base.checkpoint.model_validate(
            {"every_steps": 100, **checkpoint})})
        return evaluate(spec, ParallelSpec(dp=8, zero=zero)).memory

    sync, none = planned(1, **{"async": False}), planned(1, every_steps=0)
    assert sync.checkpoint_copy == none.checkpoint_copy == 0
    one, three = planned(1), planned(3)
    params = one.params_per_rank
    assert one.checkpoint_copy == pytest.approx(one.optimizer + 2 * params)  # bf16 weights
    assert three.checkpoint_copy == pytest.approx(three.optimizer)  # no weights in its files
    assert one.host_per_rank - sync.host_per_rank == pytest.approx(one.checkpoint_copy)
    assert one.host_per_node - sync.host_per_node == pytest.approx(8 * one.checkpoint_copy)
    small_host = get_profile("a100-80gb").with_(host_memory_bytes=one.host_per_node - 1)
    spec = base.model_copy(update={"checkpoint": base.checkpoint.model_validate(
        {"every_steps": 100})})
    tight = evaluate(spec, ParallelSpec(dp=8, zero=1), profile=small_host)
    assert not tight.fits and any("host memory" in r for r in tight.reasons)
    assert "a save in the background" in render_plan(tight)


def test_recompute_and_sp_order_memory_and_time() -> None:
    # A stack without flash attention: there selective recompute drops the stored scores.
    spec = job("gpt3-6.7b", gb=8).model_copy(deep=True)
    spec.train.stack = "megatron-deepspeed"
    mems, times = {}, {}
    for rc in ("none", "selective", "full"):
        p = evaluate(spec, ParallelSpec(tp=4, dp=2, recompute=rc))
        mems[rc], times[rc] = p.memory.activations, p.time.compute_s
    assert mems["none"] > mems["selective"] > mems["full"]
    assert times["none"] < times["selective"] < times["full"]
    sp = evaluate(spec, ParallelSpec(tp=4, dp=2, sequence_parallel=True))
    assert sp.memory.activations < mems["none"]


def test_bubble_follows_micro_batches_and_interleaving() -> None:
    spec = job("gpt3-13b", gb=32)
    p1 = evaluate(spec, ParallelSpec(tp=2, pp=4), micro_batch=1)  # m = 32
    p8 = evaluate(spec, ParallelSpec(tp=2, pp=4), micro_batch=8)  # m = 4
    assert p1.time.bubble_s / p1.time.step_s < p8.time.bubble_s / p8.time.step_s
    pv = evaluate(spec, ParallelSpec(tp=2, pp=4, virtual_stages=2), micro_batch=1)
    assert pv.time.bubble_s == pytest.approx(p1.time.bubble_s / 2, rel=0.05)


def test_evaluate_explicit_layout_even_when_it_does_not_fit() -> None:
    spec = job("gpt3-175b", gb=8, parallel=ParallelSpec(dp=8))
    plan = evaluate(spec)
    assert not plan.fits
    assert plan_json(plan)["fits"] is False
    assert "capacity 85.90 GB" in plan.reasons[0]  # 80 GiB
    with pytest.raises(ValueError, match=r"tp\(5\) does not divide heads\(96\)"):
        evaluate(spec, ParallelSpec(tp=5))


def test_plan_job_explicit_infeasible_names_bytes_and_nearest() -> None:
    spec = job("gpt3-13b", gb=16, parallel=ParallelSpec(dp=8))
    with pytest.raises(PlanInfeasible) as err:
        plan_job(spec)
    msg = str(err.value)
    assert "> capacity 85.90 GB" in msg and "nearest layouts that fit" in msg
    assert err.value.nearest and all(p.fits for p in err.value.nearest)
    assert all(p.world_size == 8 for p in err.value.nearest)


def test_plan_job_auto_picks_the_fastest_fitting_layout() -> None:
    spec = job("gpt3-13b", gb=32)
    stored = plan_job(spec)
    res = search(spec)
    assert stored["fits"] and stored["chosen_by"] == "search"
    assert stored["tokens_per_s"] == pytest.approx(res.ranked[0].tokens_per_s)
    assert all(a.tokens_per_s >= b.tokens_per_s for a, b in zip(res.ranked, res.ranked[1:],
                                                                 strict=False))
    assert stored["search"]["explanation"]


def test_plan_job_auto_none_fits() -> None:
    with pytest.raises(PlanInfeasible, match="no layout of 8 ranks fits"):
        plan_job(job("gpt3-175b", gpu="a100-40gb", gb=8))


def test_search_keeps_reasons_with_arithmetic() -> None:
    res = search(job("gpt3-175b", nodes=2, gb=64))
    reasons = [r.reason for r in res.rejected]
    assert any("does not divide heads(96)" in r for r in reasons) or any(
        "layers(96) is not divisible" in r for r in reasons) or reasons
    assert any("not supported by DeepSpeed's pipeline engine" in r for r in reasons)
    assert any("> capacity" in r for r in reasons)
    tp_rejects = [r for r in res.rejected if set(r.layout) == {"tp"}]
    for r in tp_rejects:
        assert f"tp({r.layout['tp']})" in r.reason
    assert all(p.fits for p in res.ranked)


def test_search_every_dimension_enumerated() -> None:
    res = search(job("gpt3-1.3b", gb=16))
    seen = {k: {p.layout_json()[k] for p in res.ranked} for k in
            ("tp", "pp", "zero", "offload", "recompute", "sequence_parallel",
             "virtual_stages", "micro_batch")}
    assert seen["tp"] >= {1, 2, 4, 8} and seen["pp"] >= {1, 2, 4, 8}
    assert seen["zero"] == {0, 1, 2, 3}
    assert seen["offload"] == {"none", "optimizer", "optimizer+params"}
    assert seen["recompute"] == {"none", "selective", "full"}
    assert seen["sequence_parallel"] == {False, True}
    assert max(seen["virtual_stages"]) > 1 and max(seen["micro_batch"]) > 1


def test_can_8_a100_40gb_train_175b() -> None:
    spec = job("gpt3-175b", gpu="a100-40gb", gb=8)
    ans = can_train(spec)
    assert not ans.possible
    text = ans.text()
    assert "No layout fits" in text and "host memory" in text
    # ZeRO-3 with parameter offload fits the GPUs but not the host: 18 bytes * 1.5 per param.
    z3 = next(a for a in ans.answers if a.strategy == "ZeRO-3 + parameter offload")
    assert not z3.plan.fits_host and z3.plan.fits_device
    assert z3.plan.memory.host_per_node >= 175e9 * 18 * 1.5


def test_capacity_of_a_family_grows_with_offload() -> None:
    rows = {r.strategy: r for r in capacity("gpt3", gpu="a100-40gb", nodes=1,
                                            gpus_per_node=8)}
    assert rows["data parallel (ZeRO-0)"].params < rows["ZeRO-3"].params
    assert rows["ZeRO-2"].params <= rows["ZeRO-2 + optimizer offload"].params
    # 16-bit Adam on 8 x 40 GB: 18 bytes/param unsharded -> about 2B params at most.
    assert rows["data parallel (ZeRO-0)"].params < 40e9 / 18


def test_profile_from_measurements() -> None:
    base = get_profile("a100-80gb")
    probed = profile_from_measurements(base, matmul_flops=200e12, allreduce_busbw=150e9,
                                       name="lab-a100")
    assert probed.name == "lab-a100" and probed.intra_node_bw == 150e9
    assert probed.peak_flops_bf16 * probed.gemm_eff_max == pytest.approx(200e12)
    spec = job("gpt3-1.3b", gb=16, parallel=ParallelSpec(tp=8))
    assert evaluate(spec, profile=probed).time.step_s > evaluate(spec).time.step_s
    with pytest.raises(ValueError, match="must be positive"):
        profile_from_measurements(base, matmul_flops=0, allreduce_busbw=1)


def test_fit_overheads_recovers_injected_constants() -> None:
    base = get_profile("cpu").with_(layer_overhead_s=0.0, step_overhead_s=0.0)
    samples = []
    for layers in (2, 4, 8):
        spec = JobSpec(name="t", model={"preset": "gpt-tiny", "layers": layers},
                       train={"global_batch": 8, "micro_batch": 2, "precision": "fp32"},
                       parallel=ParallelSpec(dp=2, zero=2),
                       cluster={"gpu": "cpu", "nodes": 1, "gpus_per_node": 2})
        plan = evaluate(spec, profile=base)
        passes = plan.scenario.micro_batches * layers
        samples.append((plan, plan.time.step_s + 2e-3 * passes + 7e-3))
    fitted = fit_overheads(samples)
    assert fitted.layer_overhead_s == pytest.approx(2e-3, rel=1e-6)
    assert fitted.step_overhead_s == pytest.approx(7e-3, rel=1e-6)


def test_reports_render() -> None:
    spec = job("gpt3-1.3b", gb=16)
    res = search(spec)
    text = render_search(res, top=5)
    assert "layouts fit" in text and "MFU" in text
    assert "tokens/s" in render_plan(res.ranked[0])


def test_plan_command_explicit_and_auto() -> None:
    bad = job("gpt3-13b", gb=16, parallel=ParallelSpec(dp=8))
    out = plan_command(bad, as_json=True)
    assert isinstance(out, dict) and out["fits"] is False and out["layout"]["dp"] == 8
    text = plan_command(bad)
    assert isinstance(text, str) and "Nearest layouts that fit" in text
    auto = plan_command(job("gpt3-1.3b", gb=16), top=3, as_json=True)
    assert isinstance(auto, dict) and len(auto["ranked"]) == 3 and auto["best"]["fits"]
    assert "No layout fits" in render_can_train(can_train(job("gpt3-175b", gpu="a100-40gb",
                                                              gb=8)))


def test_reduce_bucket_is_resident_whole_on_gpus_but_only_as_written_on_cpu_ranks() -> None:
    spec = JobSpec.model_validate({"name": "b", "model": {"preset": "gpt-tiny"},
                                   "train": {"global_batch": 8, "micro_batch": 2,
                                             "precision": "fp32"},
                                   "parallel": {"dp": 2, "zero": 2}})
    params = ModelShape.from_spec(spec.model).total_params
    cpu = plan_json(evaluate(spec))["memory"]
    gpu = plan_json(evaluate(spec, profile=get_profile("a100-80gb")))["memory"]
    assert cpu["zero_buffers"] == pytest.approx(params * 4)  # fp32 gradients, one bucket
    assert gpu["zero_buffers"] == pytest.approx(5e8 * 4)  # DeepSpeed's default bucket


def test_divisors_are_every_divisor_in_order() -> None:
    from service.planner.search import divisors

    for n in [*range(1, 400), 720720, 1048576, 1048575]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def _counting_assess(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    import importlib

    # `service.planner.search` the attribute is the function; the module is imported by name.
    search_module = importlib.import_module("service.planner.search")
    calls = [0]
    real = search_module.assess

    def counted(sc):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(sc)

    monkeypatch.setattr(search_module, "assess", counted)
    return calls


def test_search_work_is_bounded_by_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worst searches (a highly composite world, batch and layer count) stop after the
    budget's number of candidates, counted, not timed."""
    from service.planner import SearchTooLarge
    from service.planner.search import SEARCH_BUDGET

    calls = _counting_assess(monkeypatch)
    worst = JobSpec.model_validate({
        "name": "worst", "model": {"layers": 720, "hidden": 720, "heads": 720, "vocab": 256,
                                   "seq_len": 32},
        "train": {"global_batch": 720720}, "parallel": "auto",
        "cluster": {"gpu": "a100-80gb", "nodes": 630, "gpus_per_node": 8}})
    with pytest.raises(SearchTooLarge, match=f"more than {SEARCH_BUDGET} candidates"):
        search(worst)
    assert 0 < calls[0] <= SEARCH_BUDGET
    calls[0] = 0
    with pytest.raises(SearchTooLarge, match="more than 50 candidates"):
        search(worst, budget=50)
    assert calls[0] <= 50
    # The refusal reaches plan_job (a 422 at the API) as a ValueError.
    with pytest.raises(ValueError, match="give an explicit parallel layout"):
        plan_job(worst)


def test_micro_batches_stop_at_the_largest_a_spec_accepts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of 2^20 sequences on 2 CPU ranks: micro-batches up to 65536 only, so that the
    chosen layout is one the spec accepts, within the budget."""
    from service.contract.spec import MAX_MICRO_BATCH
    from service.submission.intake import prepare

    calls = _counting_assess(monkeypatch)
    spec = JobSpec.model_validate({
        "name": "big-batch", "model": {"preset": "gpt-tiny"},
        "train": {"global_batch": 1 << 20}, "parallel": "auto",
        "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 2}})
    res = search(spec)
    assert res.best is not None and res.work <= res.budget and calls[0] == res.considered
    assert max(p.micro_batch for p in res.ranked) == MAX_MICRO_BATCH
    assert prepare(spec).spec.train.micro_batch <= MAX_MICRO_BATCH


def test_175b_on_1024_gpus_fits_the_search_budget() -> None:
    res = search(job("gpt3-175b", nodes=128, gb=1536))
    assert res.best is not None and res.work <= res.budget


def test_the_cpu_bound_counts_the_search_not_the_garbage_collections_in_its_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A full garbage collection walks every object of the process: in a large process it
    takes longer than the API's bound, and a small search in whose thread one ran was
    refused. The collection's CPU time moves the deadline; the search's own work does not.
    Nor does the thread's work before the search (a submission's corpus check): the clock
    starts at the search's first candidate."""
    import gc
    import time

    from service.planner.search import SearchOutOfTime, cpu_bound

    search_module = sys.modules["service.planner.search"]  # the package's `search` is the function

    def spin(seconds: float) -> None:
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            pass

    small = JobSpec.model_validate({
        "name": "small", "model": {"preset": "gpt-tiny"}, "train": {"global_batch": 8},
        "parallel": "auto", "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 2}})
    # The bound: three times the most this search cost here in three runs (16 to 31 ms of CPU
    # on a loaded two-core machine: over a fixed 0.02 s at times), so that the search alone
    # always fits it and what the test adds (a collection, work before the search, slow
    # candidates) never does.
    search(small)  # its imports and caches, once
    costs = []
    for _ in range(3):
        began = time.thread_time()
        search(small)
        costs.append(time.thread_time() - began)
    bound = max(0.02, 3 * max(costs))
    heap: list[list[int]] = []
    for _ in range(16):  # a heap whose full collection alone spends the bound
        heap += [[i] for i in range(1_000_000)]
        start = time.thread_time()
        gc.collect()
        if time.thread_time() - start > bound:
            break
    real = search_module.assess
    collected: list[float] = []

    def collecting(*args: Any, **kw: Any) -> Any:
        if not collected:  # once, inside the search, after its clock started
            start = time.thread_time()
            gc.collect()
            collected.append(time.thread_time() - start)
        return real(*args, **kw)

    monkeypatch.setattr(search_module, "assess", collecting)
    with cpu_bound(bound):
        assert search(small).best is not None
    assert collected[0] > bound  # the collection alone spent the bound
    del heap
    monkeypatch.setattr(search_module, "assess", real)
    with cpu_bound(bound):
        spin(2 * bound)  # before the search: not the search's
        assert search(small).best is not None

    def slow(*args: Any, **kw: Any) -> Any:
        spin(bound / 16)  # the bound is looked at every 64 candidates
        return real(*args, **kw)

    monkeypatch.setattr(search_module, "assess", slow)
    with cpu_bound(bound), pytest.raises(SearchOutOfTime, match=f"{bound:g} s of CPU"):
        search(small)  # the search's own work counts


def test_search_with_a_batch_ramp_plans_the_full_batch_in_whole_micro_batches() -> None:
    """Every layout ranked runs each batch of the ramp as whole micro-batches on every replica
    (start 12, increment 4: dp * micro_batch divides 4; dp 8 is refused), with one schedule
    (no interleaving), and is timed at the full batch."""
    spec = job("gpt3-1.3b", gb=64).model_copy(deep=True)
    spec = JobSpec.model_validate({**spec.model_dump(exclude_unset=True), "train": {
        "global_batch": 64, "micro_batch": 1, "precision": "bf16",
        "batch_ramp": {"start": 12, "increment": 4, "samples": 1000}}})
    res = search(spec)
    plain = search(job("gpt3-1.3b", gb=64))
    assert res.ranked
    for p in res.ranked:
        lay = p.layout_json()
        assert 4 % (lay["dp"] * lay["micro_batch"]) == 0 and lay["virtual_stages"] == 1, lay
    assert any(4 % (p.layout_json()["dp"] * p.layout_json()["micro_batch"])
               for p in plain.ranked)  # without the ramp such layouts are ranked
    assert any("train.batch_ramp" in r.reason for r in res.rejected)
    assert all(p.scenario.global_batch == 64 for p in res.ranked)
