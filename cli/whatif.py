"""`trident plan --compare JOB`: a what-if against a job's measurement.

The server plans the what-if (`POST /plan`, with the profile `trident probe` calibrated, as it
planned the job) and gives the job's plan next to what its ranks measured. How far the
measured step time is from the job's prediction (`measured / predicted`) is the correction
this cluster and stack need: the what-if's expected step time is its prediction times that
ratio, its tokens/s divided by it. When the what-if's layout is another than the job's, what
the move would cost (save, convert, resume: `service.planner.relayout`) comes with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel

from cli.common import connect, fail
from cli.memory_view import memory_gap_lines
from cli.spec import apply_sets, read_spec_file, validate_spec
from client.payloads import (
    JobOut,
    Measured,
    MeasuredMemory,
    Number,
    PlanOut,
    StageMemoryGap,
)
from client.rest import model_json
from service.planner.explain import constants_text
from service.planner.relayout import move_cost
from service.planner.shape import ModelShape
from service.planner.stored import PlannedLayout


def _label(layout: PlannedLayout) -> str:
    return f"{layout.label} mb{layout.micro_batch}"


def _num(value: float | None, scale: float, unit: str, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f} {unit}"


# --- what `plan --compare --json` prints (docs/cli.md), its fields in this order ---------------

class JobSide(BaseModel):
    """The job: its layout, and its plan against its measurement."""

    id: int
    name: str
    state: str
    layout: str
    steps_measured: int
    step_s: Measured
    tokens_per_s: Measured
    memory_bytes: MeasuredMemory | None
    memory_by_stage: list[StageMemoryGap] = []
    """Each memory category of each stage, planned against measured, with the gap."""


class WhatIfSide(BaseModel):
    """The what-if's plan."""

    layout: str
    fits: bool
    reasons: list[str]
    step_s: Number
    tokens_per_s: Number
    memory_bytes: Number
    constants: dict[str, dict[str, Any]]
    """The plan's step-time constants, each `measured` on this cluster (by which probe or
    calibration, when) or `assumed` (from where): `constants` of the plan JSON."""


class Expected(BaseModel):
    """The what-if's prediction times the job's measured/predicted step time."""

    ratio: float | None
    step_s: float | None
    tokens_per_s: float | None


class Move(BaseModel):
    """What moving the job to the what-if's layout costs (`service.planner.relayout`): its
    tag saved, converted by `path`, resumed from; seconds from measured rates (`source`)."""

    path: str
    tag_bytes: int
    save_s: float
    convert_s: float
    resume_s: float
    total_s: float
    source: str


class Comparison(BaseModel):
    job: JobSide
    what_if: WhatIfSide
    expected: Expected
    move: Move | None = None
    """None when the layouts are the same (tp, pp, dp, ZeRO, virtual stages)."""


def move_of(job: JobOut, plan: PlanOut) -> Move | None:
    """What moving `job` to `plan`'s layout costs; None for the same layout."""
    old, new = job.plan.layout.parallel, plan.layout.parallel
    if all(getattr(old, k) == getattr(new, k)
           for k in ("tp", "pp", "dp", "zero", "virtual_stages")):
        return None
    cost = move_cost(ModelShape.from_spec(job.spec.planned_model), job.spec.train.precision,
                     old, new)
    return Move(path=cost.path, tag_bytes=cost.tag_bytes, save_s=cost.save_s,
                convert_s=cost.convert_s, resume_s=cost.resume_s, total_s=cost.total_s,
                source=cost.source)


def compare_rows(job: JobOut, plan: PlanOut) -> Comparison:
    """The what-if next to the job: predictions, the job's measurement, and what the job's
    measured/predicted ratio makes of the what-if."""
    pvm = job.predicted_vs_measured
    step = pvm.step_s if pvm else Measured()
    ratio = step.ratio
    if plan.time is None or plan.memory is None or plan.tokens_per_s is None:
        raise ValueError("the what-if is not planned")  # POST /plan plans, or refuses (422)
    what_step = plan.time.step_s
    return Comparison(
        job=JobSide(id=job.id, name=job.name, state=job.state.value,
                    layout=_label(job.plan.layout),
                    steps_measured=pvm.steps_measured if pvm else 0, step_s=step,
                    tokens_per_s=pvm.tokens_per_s if pvm else Measured(),
                    memory_bytes=pvm.memory_bytes if pvm else None,
                    memory_by_stage=pvm.memory_by_stage if pvm else []),
        what_if=WhatIfSide(layout=_label(plan.layout), fits=plan.fits, reasons=plan.reasons,
                           step_s=what_step, tokens_per_s=plan.tokens_per_s,
                           memory_bytes=plan.memory.total,
                           constants=(plan.model_extra or {}).get("constants", {})),
        expected=Expected(ratio=ratio, step_s=what_step * ratio if ratio else None,
                          tokens_per_s=plan.tokens_per_s / ratio if ratio else None),
        move=move_of(job, plan))


def move_text(m: Move) -> str:
    """The move's line of the what-if."""
    return (f"moving there costs about {m.total_s:,.1f} s: save {m.save_s:,.1f} s, convert"
            f" {m.convert_s:,.1f} s ({m.path}), resume {m.resume_s:,.1f} s, a"
            f" {m.tag_bytes / 1e9:,.2f} GB tag (rates of {m.source})")


def render(rows: Comparison) -> str:
    j, w, e = rows.job, rows.what_if, rows.expected
    head = f"job {j.id} ({j.layout})"
    width = max(26, len(head) + 2)
    ratio = e.ratio
    memory = j.memory_bytes

    def row(label: str, left: str, right: str) -> str:
        return f"{label:<24}{left:<{width}}{right}".rstrip()

    misfit = "" if w.fits else f"  (does not fit: {'; '.join(w.reasons)})"
    return "\n".join([
        f"what-if against job {j.id} {j.name}: {j.state},"
        f" {j.steps_measured} steady steps measured",
        row("", head, f"what-if ({w.layout})"),
        row("step time predicted", _num(j.step_s.predicted, 1e3, "ms"),
            _num(w.step_s, 1e3, "ms")),
        row("step time measured", _num(j.step_s.measured, 1e3, "ms"),
            f"expected {_num(e.step_s, 1e3, 'ms')} (predicted x {ratio:.2f}, the job's"
            " measured/predicted)" if ratio else "expected - (the job has no measured steps"
            " yet)"),
        row("tokens/s predicted", _num(j.tokens_per_s.predicted, 1, "", 0),
            _num(w.tokens_per_s, 1, "", 0)),
        row("tokens/s measured", _num(j.tokens_per_s.measured, 1, "", 0),
            f"expected {_num(e.tokens_per_s, 1, '', 0)}" if ratio else "expected -"),
        row("memory/GPU predicted", _num(memory.predicted if memory else None, 1e-9, "GB", 2),
            _num(w.memory_bytes, 1e-9, "GB", 2) + misfit),
        row("memory/GPU peak", _num(memory.measured_peak if memory else None, 1e-9, "GB", 2),
            ""),
        *([move_text(rows.move)] if rows.move else []),
        f"job {j.id}'s memory by stage, planned against measured:",
        *memory_gap_lines(j.memory_by_stage),
        "what-if's constants:",
        *(f"  {line}" for line in constants_text(w.constants)),
    ])


def what_if(server: str, job_id: int, spec: Path | None, sets: list[str],
            as_json: bool) -> None:
    """Plan `spec` (default: the job's stored spec) with `sets` applied, on the server, and
    print it against job `job_id`'s measurement."""
    with connect(server) as client:
        job = client.get_job(job_id)
        if not job.plan.planned:
            fail(f"job {job_id} is not planned (a command job without model, placed from"
                 " resources alone): there is no prediction to set a what-if against")
        raw = read_spec_file(spec) if spec is not None else job.spec.model_dump(mode="json")
        checked = validate_spec(apply_sets(raw, sets), str(spec or f"job {job_id}'s spec"),
                                sets)
        if checked.parallel == "auto":
            fail("--compare needs an explicit layout: set parallel (e.g. --set"
                 " parallel.tp=2), or run `trident plan SPEC` for the ranked layouts")
        plan = client.plan(checked)
    assert isinstance(plan, PlanOut)  # an explicit layout: one plan, not a search
    rows = compare_rows(job, plan)
    typer.echo(json.dumps(model_json(rows), indent=2) if as_json else render(rows))
