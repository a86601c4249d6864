"""`bench/checkpoint_scale.py` at its quick size (a 4-layer GPT of hidden 64 on 2 CPU ranks):
every part of the benchmark runs and reports what docs/benchmarks.md reads from it. Its figures
are not judged here (no timed tests): the full size is run by hand (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

from bench.checkpoint_scale import MOVES, SIZES, measure


def test_the_quick_checkpoint_benchmark_reports_every_part(tmp_path: Path,
                                                          capsys) -> None:
    summary = measure(dict(SIZES["quick"]), 1, tmp_path)
    rows = [line for line in capsys.readouterr().out.splitlines() if '"process"' in line]
    assert summary["blocked_sync_s"] > 0 and summary["blocked_async_s"] > 0
    assert summary["async_over_sync"] is not None
    assert set(summary["resume"]) == {name for name, _, _ in MOVES}
    for move in summary["resume"].values():
        assert move["resume_s"] > 0 and move["tag_bytes"] > 0
    assert summary["largest_tensor_bytes"] == 256 * 64 * 4  # the embedding, fp32
    text = "\n".join(rows)
    for what in ("save (sync)", "save (async)", "tp 2 -> 1 resume", "pp 1 -> 2 resume",
                 "ZeRO-1 -> 3 resume", "export of a tp2 dp1 zero1 tag",
                 "export of a dp2 zero3 tag"):
        assert f'"what": "{what}"' in text, what
    assert text.count('"process": "rank 0"') >= 5 and text.count('"process": "rank 1"') >= 5
    assert '"peak_over_own_shard"' in text and '"added_over_own_shard"' in text
