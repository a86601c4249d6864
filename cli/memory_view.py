"""Each memory category planned against measured, per pipeline stage, as text: what
`trident describe JOB` and `trident plan --compare JOB` print from the job's
`predicted_vs_measured.memory_by_stage` (`service.views.memory_gap`)."""

from __future__ import annotations

from collections.abc import Sequence

from cli.format import columns, size
from client.payloads import CategoryGap, StageMemoryGap


def _gap(c: CategoryGap) -> tuple[str, str]:
    if c.gap is None:
        return "-", "-"
    sign = "+" if c.gap >= 0 else "-"
    pct = "-" if c.gap_pct is None else f"{100 * c.gap_pct:+.1f}%"
    return f"{sign}{size(abs(c.gap))}", pct


def _measured(c: CategoryGap) -> str:
    if c.measured is not None:
        return size(c.measured)
    return "not measured" if c.not_measured else "-"


def memory_gap_lines(stages: Sequence[StageMemoryGap]) -> list[str]:
    """One table per stage: category, planned, measured, gap, gap %."""
    if not stages:
        return ["  (no plan by stage)"]
    out: list[str] = []
    for st in stages:
        who = (f"ranks {', '.join(map(str, st.ranks))}, step {st.step}" if st.ranks
               else "no measurement yet")
        out.append(f"  stage {st.stage} ({who}):")
        rows = [[c.label, size(c.planned), _measured(c), *_gap(c)] for c in st.categories]
        out += ["    " + line for line in columns(
            ["CATEGORY", "PLANNED", "MEASURED", "GAP", "GAP %"], rows).splitlines()]
        out += [f"    not measured, {c.label}: {c.not_measured}" for c in st.categories
                if c.measured is None and c.not_measured]
    return out
