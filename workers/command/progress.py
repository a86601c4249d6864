"""A command job's steps, read from what its script writes: the lines of one rank's output
that match its progress pattern (`ProgressReader`), and the JSON lines a rank writes to the
file named by `TRIDENT_REPORT` (`read_report_lines`).

Both give dicts of `service.contract.reports.StepReport`'s fields, as far as the script said
them; the runner that reads the rank's output adds what only it knows (the rank, the step's
wall time) and validates the whole into a `StepReport`. Nothing here raises on what a script
prints or writes: a line that does not match is not a step, a report line that is not a valid
report is skipped with a one-line reason.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from pydantic import Field, ValidationError, model_validator

from service.contract.command import LINE_MAX, PRESETS, ProgressSpec
from service.contract.reports import StepReport

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
"""Terminal colour and cursor escapes (torchtitan colours its line)."""
STEP_MAX = 10_000_000
"""Highest step a report may carry (`StepReport.step`)."""
REPORT_READ_MAX = 1 << 20
"""Bytes of the report file read in one call (a longer line is skipped as bad)."""
SET_BY_TRIDENT = frozenset({"kind", "rank"})
"""Fields of the step report a report line must not give: Trident knows them from the file."""


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip("'\""))
    except ValueError:
        return None


class ProgressReader:
    """Step reports from the lines of one rank's output, by `spec`'s pattern.

    `world_size` scales a preset's per-device tokens/s (torchtitan's `tps`) to the global
    figure a step report carries. A preset whose lines carry no step (hf-trainer) counts its
    matching lines: the n-th is step `resume_step` + n * `spec.logging_steps` (an attempt
    that resumes from the checkpoint of step `resume_step`, `TRIDENT_RESUME_STEP`, logs from
    the step after it).
    """

    def __init__(self, spec: ProgressSpec, *, world_size: int = 1, resume_step: int = 0) -> None:
        self.spec = spec
        self.resume_step = resume_step
        self.pattern = spec.pattern()
        preset = PRESETS[spec.preset] if spec.preset else None
        self.counts_lines = bool(preset and preset.counts_lines)
        self.tokens_scale = world_size if preset and preset.tokens_per_device else 1
        self.zero_loss_is_none = bool(preset and preset.zero_loss_is_none)
        self.matched = 0
        """Lines that gave a step report so far."""

    def feed(self, line: str) -> dict[str, Any] | None:
        """The step report `line` gives (`step` and whichever of `loss`, `tokens_per_s`, `lr`,
        `grad_norm` it names), or None when it is not a progress line."""
        found = None
        # A progress bar rewrites its line with carriage returns: each part is a line.
        for part in _ANSI.sub("", line[:LINE_MAX]).split("\r"):
            found = self.pattern.search(part) or found
        if found is None:
            return None
        groups = {k: v for k, v in found.groupdict().items() if v is not None}
        if self.counts_lines:
            step = self.resume_step + (self.matched + 1) * self.spec.logging_steps
        else:
            try:
                step = int(groups.get("step", ""))
            except ValueError:
                return None
        if not 1 <= step <= STEP_MAX:
            return None
        out: dict[str, Any] = {"step": step}
        for name in ("loss", "tokens_per_s", "lr", "grad_norm"):
            value = _number(groups[name]) if name in groups else None
            if value is None:
                continue
            if name == "tokens_per_s":
                value *= self.tokens_scale
            if name == "loss" and value == 0 and self.zero_loss_is_none:
                continue  # no iteration of the interval had a loss
            if name != "loss" and not (math.isfinite(value) and value >= 0):
                continue  # not a figure the report can hold (a norm of nan: not measured)
            if name == "lr" and value > 10:
                continue
            out[name] = value
        self.matched += 1
        return out


class _ReportLine(StepReport):
    """A line of the report file: the step report's fields, all but `step` optional."""

    rank: int | None = Field(default=None, ge=0, le=65535)  # type: ignore[assignment]
    step_time_s: float | None = Field(default=None, ge=0, le=86400)  # type: ignore[assignment]
    tokens_per_s: float | None = Field(default=None, ge=0)  # type: ignore[assignment]

    @model_validator(mode="after")
    def _bubble_within_step(self) -> _ReportLine:  # type: ignore[override]
        if self.bubble_s is not None and self.step_time_s is not None \
                and self.bubble_s > self.step_time_s:
            raise ValueError(f"bubble_s ({self.bubble_s}) exceeds step_time_s"
                             f" ({self.step_time_s}): the bubble is part of the step")
        return self


def report_line(text: str) -> dict[str, Any]:
    """The step report one line of the report file gives; ValueError with a one-line reason
    when it is not one."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object: {type(data).__name__}")
    given = sorted(SET_BY_TRIDENT & set(data))
    if given:
        raise ValueError(f"{', '.join(given)}: set by Trident, not by the report")
    try:
        report = _ReportLine.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "report"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ValueError(f"{where}: {first['msg']}{more}"[:300]) from None
    return report.model_dump(exclude_unset=True, exclude={"kind"})


def read_report_lines(path: str | os.PathLike[str], offset: int,
                      errors: list[str] | None = None) -> tuple[list[dict[str, Any]], int]:
    """The step reports of the complete lines of the report file at `path` after byte
    `offset`, and the offset to read from next (after the last complete line read; a line
    being written is left for the next call).

    A line that is not a valid report is skipped; its reason (one line, `byte <offset>:
    <why>`) is appended to `errors` when given. A missing file has no reports yet; a file
    shorter than `offset` was started again and is read from its beginning.
    """
    errors = errors if errors is not None else []
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < offset:
                errors.append(f"byte {offset}: the file is shorter ({size} bytes) than what was"
                              " read of it: read again from its start")
                offset = 0
            f.seek(offset)
            chunk = f.read(REPORT_READ_MAX)
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1
    if end == 0:
        if len(chunk) < REPORT_READ_MAX:
            return [], offset  # a line still being written
        errors.append(f"byte {offset}: a line longer than {REPORT_READ_MAX} bytes: skipped")
        return [], offset + len(chunk)
    reports = []
    at = offset
    for raw in chunk[:end].split(b"\n")[:-1]:
        text = raw.decode("utf-8", errors="replace").strip()
        if text:
            try:
                reports.append(report_line(text))
            except ValueError as e:
                errors.append(f"byte {at}: {e}".replace("\n", " "))
        at += len(raw) + 1
    return reports, offset + end
