"""A rank's `trident profile` profiler (`workers.monitor.profiler.StepProfiler`) in this
process, around a small model's steps as the trainer marks them: the profiled steps are whole
`ProfilerStep#<step>` ranges of the job's own step numbers, the losses are those of the same
steps unprofiled, and the answer says what it has when training ends first, when a trace is
over its bound, or when another request holds the rank (the ranks on Ray are in
test_profile_ray.py)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from workers.monitor.profiler import Busy, StepProfiler


def losses(profiler: StepProfiler | None, steps: int) -> list[float]:
    """A small model trained `steps` steps, each marked as the trainer marks its steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(steps, 8, 16, generator=torch.Generator().manual_seed(1))
    out = []
    for step in range(1, steps + 1):
        if profiler is not None:
            profiler.step_started(step)
        loss = model(data[step - 1]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
        if profiler is not None:
            profiler.step_ended(step)
    return out


def events(data: bytes) -> list[dict]:
    return json.loads(gzip.decompress(data))["traceEvents"]


def test_profiled_steps_are_whole_ranges_and_change_no_loss() -> None:
    p = StepProfiler(3)
    p.arm(7, steps=2, memory=True, start=3, max_bytes=64 << 20)
    with pytest.raises(Busy, match="request 7"):
        p.arm(8, steps=1, memory=False, start=1, max_bytes=64 << 20)
    assert losses(p, 6) == losses(None, 6)  # the same numbers, exactly
    answer = p.result(7)
    assert answer is not None and answer["error"] is None and answer["steps"] == [3, 4]
    assert sorted(answer["files"]) == ["rank-3.memory-timeline.json.gz",
                                       "rank-3.pt.trace.json.gz"]
    trace = events(answer["files"]["rank-3.pt.trace.json.gz"])
    steps = {e["name"]: e for e in trace if e["name"].startswith("ProfilerStep#")}
    assert sorted(steps) == ["ProfilerStep#3", "ProfilerStep#4"]
    for e in steps.values():  # each step's backward and optimizer ops lie inside its range
        inside = {o["name"] for o in trace if o.get("cat") == "cpu_op"
                  and e["ts"] <= o["ts"] <= e["ts"] + e["dur"]}
        assert e["ph"] == "X" and "aten::addmm" in inside, inside
    assert any(o.get("cat") == "cpu_instant_event" and "Total Allocated" in o.get("args", {})
               for o in trace)  # --memory: the allocations
    times, sizes = json.loads(gzip.decompress(
        answer["files"]["rank-3.memory-timeline.json.gz"]))
    assert len(times) == len(sizes) > 0
    assert p.result(7) is None  # taken once
    p.arm(8, steps=1, memory=False, start=1, max_bytes=64 << 20)  # free again


def test_the_answer_says_what_it_has_when_training_ends_or_a_trace_is_too_big() -> None:
    p = StepProfiler(0)
    p.arm(1, steps=5, memory=False, start=2, max_bytes=64 << 20)
    losses(p, 3)
    p.close("training ended")  # steps 2 and 3 of 5 profiled: sent as they are
    answer = p.result(1)
    assert answer is not None and answer["steps"] == [2, 3] and answer["error"] is None
    assert {e["name"] for e in events(answer["files"]["rank-0.pt.trace.json.gz"])
            if e["name"].startswith("ProfilerStep#")} == {"ProfilerStep#2", "ProfilerStep#3"}
    p.arm(2, steps=1, memory=False, start=10, max_bytes=64 << 20)
    p.close("training ended")
    assert p.result(2) == {"rank": 0, "steps": None, "files": {}, "left_out": [],
                           "error": "rank 0: training ended before a profiled step ended"}
    p.arm(3, steps=1, memory=False, start=1, max_bytes=1000)
    losses(p, 1)
    answer = p.result(3)
    assert answer is not None and answer["files"] == {}
    assert answer["left_out"][0]["name"] == "rank-0.pt.trace.json.gz"
    assert "over the per-trace limit of 1000: profile fewer steps" in answer["error"]
