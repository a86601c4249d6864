"""The `make bench` harness: its pieces, and a smoke run of one comparison at its quick size
(`python -m bench.run --quick --only scale --db sqlite`) that checks the report's structure.
The full benchmark is not run in the tests (see docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.harness import Section, alternate, dist, markdown, pct
from bench.orchestration import stages

ROOT = Path(__file__).resolve().parent.parent


def test_percentiles_and_alternation() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert pct(xs, 10) == 11.0 and pct(xs, 90) == 90.0 and pct(xs, 99) == 99.0
    d = dist(xs)
    assert (d["median"], d["n"]) == (50.5, 100)
    order: list[str] = []
    alternate(lambda: order.append("a") or 1.0, lambda: order.append("b") or 2.0, 4)
    assert "".join(order) == "abbaabba"


def test_trident_first_step_is_split_by_the_jobs_events() -> None:
    ev = [{"kind": "state", "time": "2026-01-01T00:00:00.100+00:00", "data": {"to": "QUEUED"}},
          {"kind": "state", "time": "2026-01-01T00:00:00.500+00:00", "data": {"to": "PLACING"}},
          {"kind": "placement", "time": "2026-01-01T00:00:01.500+00:00", "data": {}},
          {"kind": "rendezvous", "time": "2026-01-01T00:00:04.500+00:00", "data": {}},
          {"kind": "state", "time": "2026-01-01T00:00:04.600+00:00", "data": {"to": "RUNNING"}},
          {"kind": "probe", "time": "2026-01-01T00:00:06.500+00:00", "data": {}}]
    metrics = [{"time": "2026-01-01T00:00:09.000+00:00", "step_time_s": 0.5 + i / 100}
               for i in range(10)]
    t0 = 1767225600.0  # 2026-01-01T00:00:00Z
    got = stages(t0, ev, metrics)
    assert list(got["stages"]) == ["admission", "placement group", "actor start and rendezvous",
                                   "probe", "DeepSpeed init, first step and its report"]
    assert [round(v, 3) for v in got["stages"].values()] == [0.5, 1.0, 3.0, 2.0, 2.5]
    assert round(got["first_step_s"], 3) == 9.0
    assert round(got["submit_to_running_s"], 3) == 4.6
    assert round(got["step_s"], 3) == 0.56  # median of steps 4-10, past the warm-up


def test_markdown_names_goals_met_and_not() -> None:
    s = Section("x", "A comparison")
    s.row("thing", "1.5x", "detail")
    s.goal("fast", 0.01, "< 0.05", True)
    s.goal("faster", 0.2, "< 0.05", False, "the machine")
    report = {"command": "make bench", "started": "now", "seconds": 1.0,
              "machine": {"cpus": 2, "memory_bytes": 2**34},
              "sections": {"x": {"title": s.title, "error": None, "rows": s.rows,
                                 "goals": [g.__dict__ for g in s.goals]}}}
    md = markdown(report)
    assert "2 CPUs, 16 GiB memory" in md
    assert "| thing | 1.5x | detail |" in md
    assert "| fast | 0.01 | < 0.05 | yes |" in md
    assert "| faster | 0.2 | < 0.05 | **no** (the machine) |" in md


def test_quick_scale_run_writes_the_report(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--only", "scale",
                           "--db", "sqlite", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["machine"]["cpus"] >= 1
    sec = report["sections"]["scale"]
    assert sec["error"] is None
    fig = sec["figures"]["sqlite"]
    assert fig["jobs"] == 2000 and fig["metric_rows"] == 8000
    assert {"list_first_page", "list_queued", "detail_job_with_metrics",
            "job_page_metrics"} <= set(fig["latency"])
    assert fig["controller"]["running"] == 20
    ingest = fig["ingest"]
    assert ingest["stored_steps"] >= 3 and ingest["complete_steps"] == ingest["stored_steps"]
    # A 512-rank job keeps rank 0, 32 sampled ranks and its straggler (rank 1234 % 512).
    assert ingest["per_rank_rows_per_step"] == 33
    assert ingest["limit_ranks_at_1_step_per_s"] > 0
    goals = {g["name"] for g in sec["goals"]}
    assert "sqlite controller pass median (s)" in goals
    md = (tmp_path / "report.md").read_text()
    assert "## Store and controller at scale" in md and "| goal | measured |" in md


def test_a_failing_client_fails_the_round_instead_of_hanging_it() -> None:
    import pytest

    from bench.control_plane import clients

    calls = {"n": 0}

    def submit(c: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise ConnectionError("server went away")

    with pytest.raises(RuntimeError, match="server went away"):
        clients(4, 5, submit, object)
    lat, seconds = clients(2, 3, lambda c: None, object)
    assert len(lat) == 6 and seconds >= 0
