"""How a `command:` job's progress is read: the `progress:` part of its spec and the ready
patterns for the common trainers.

A command job runs the team's own script (`docs/command.md`); Trident learns of its steps
from the lines one rank prints (`ProgressSpec`) and from the JSON lines a rank may write to
`TRIDENT_REPORT` (`workers.command.progress`). The patterns of `PRESETS` are copied from the
log lines of the programs they name (the sources are cited beside each, and
`tests/test_command_progress.py` parses lines those programs print).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

GROUPS = ("step", "loss", "tokens_per_s", "lr", "grad_norm")
"""Named groups a progress pattern may use: fields of `service.contract.reports.StepReport`.
`step` is required (except in a preset that counts its lines, `hf-trainer`)."""
REGEX_MAX = 1000
"""Longest `progress.regex`."""
LINE_MAX = 4096
"""Characters of a log line a pattern is matched against (the rest of a longer line is not
read): bounds the work of one match."""

_NUM = r"[-+]?(?:nan|inf|[0-9][0-9,]*(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)"
"""A number as the trainers print it: `7.4187`, `1.000000E-04`, `5e-05`, `12,345` (torchtitan's
thousands separators), `nan`."""


@dataclass(frozen=True)
class Preset:
    """A ready progress pattern for one trainer's log line."""

    regex: str
    source: str
    """Where the line is printed (repository and file), so the pattern can follow it."""
    counts_lines: bool = False
    """True when the line carries no step: the n-th matching line is step
    n * `ProgressSpec.logging_steps`."""
    tokens_per_device: bool = False
    """True when the line's `tokens_per_s` is one device's: multiplied by the world size to
    give the step report's (global) figure."""
    zero_loss_is_none: bool = False
    """True when the line prints a loss of 0 for an interval with no loss (every iteration
    of it skipped): the step is reported without a loss."""


PRESETS: dict[str, Preset] = {
    # logger.info(f"step: {step:2}  loss: {loss:7.4f}  grad_norm: {grad_norm:7.4f}
    #   memory: ...GiB(...%)  tps: {round(tps):,}  tflops: ...  mfu: ...%"), coloured with
    # ANSI escapes (removed before matching); grad_norm is absent in some versions. Not its
    # `validate step: ...` line, nor another `<word> step:`.
    "torchtitan": Preset(
        regex=(rf"(?<![A-Za-z] )\bstep:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{_NUM})"
               rf"(?:\s+grad_norm:\s*(?P<grad_norm>{_NUM}))?"
               rf"(?:.*?\btps:\s*(?P<tokens_per_s>{_NUM}))?"),
        source="pytorch/torchtitan torchtitan/components/metrics.py (MetricsProcessor.log)",
        tokens_per_device=True),
    # ProgressCallback / PrinterCallback print the `log` dict: `{'loss': 2.3, 'grad_norm': 1.2,
    # 'learning_rate': 5e-05, 'epoch': 0.5}` (transformers >= 5 prints the floats as
    # strings: `{'loss': '2.303', ...}`). No step in it: lines are counted.
    "hf-trainer": Preset(
        regex=(rf"\{{'loss': '?(?P<loss>{_NUM})'?"
               rf"(?:, 'grad_norm': '?(?P<grad_norm>{_NUM})'?)?"
               rf"(?:, 'learning_rate': '?(?P<lr>{_NUM})'?)?"),
        source="huggingface/transformers src/transformers/trainer_callback.py"
               " (ProgressCallback.on_log, PrinterCallback.on_log)",
        counts_lines=True),
    # training_log: ` iteration {:8d}/{:8d} | consumed samples: ... | elapsed time per
    # iteration (ms): ... | learning rate: {:.6E} | global batch size: ... | lm loss: {:.6E} |
    # loss scale: ... | grad norm: {:.3f} | ...`
    "megatron": Preset(
        regex=(rf"iteration\s+(?P<step>\d+)/\s*\d+\s*\|"
               rf"(?:.*?\blearning rate: (?P<lr>{_NUM}) \|)?"
               rf".*?\blm loss: (?P<loss>{_NUM}) \|"
               rf"(?:.*?\bgrad norm: (?P<grad_norm>{_NUM}) \|)?"),
        source="NVIDIA/Megatron-LM megatron/training/training.py (training_log)",
        zero_loss_is_none=True),  # its average over the interval's advanced iterations
}


class ProgressSpec(BaseModel):
    """Where a command job's steps come from: the lines of one rank's output that match a
    pattern (a regex of your own, or a preset for a common trainer). Every matching line is
    one step report; the JSON lines a rank writes to `TRIDENT_REPORT` are read beside them
    (`docs/command.md`)."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    regex: Annotated[str, Field(min_length=1, max_length=REGEX_MAX)] | None = None
    """A Python regular expression searched in each line: it must name a group `step` (an
    integer, the 1-based optimizer step) and may name `loss`, `tokens_per_s` (global tokens per
    second), `lr` and `grad_norm`."""
    preset: Literal["torchtitan", "hf-trainer", "megatron"] | None = None
    """A ready pattern for that trainer's log line (`PRESETS`)."""
    rank: Annotated[int, Field(ge=0, le=65535)] = 0
    """The rank whose output is read (its lines only; every rank's output is its rank log)."""
    logging_steps: Annotated[int, Field(ge=1, le=1_000_000)] = 1
    """With `preset: hf-trainer`, whose lines carry no step: the Trainer's `logging_steps`;
    the n-th matching line is step n * logging_steps."""

    @field_validator("regex")
    @classmethod
    def _pattern(cls, v: str | None) -> str | None:
        if v is not None:
            pattern_errors(v)
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ProgressSpec:
        if (self.regex is None) == (self.preset is None):
            raise ValueError("progress: give exactly one of `regex` and `preset`"
                             f" (got {'both' if self.regex else 'neither'})")
        if self.logging_steps != 1 and not (self.preset and PRESETS[self.preset].counts_lines):
            raise ValueError("progress.logging_steps: only for a preset whose lines carry no"
                             " step (hf-trainer); the pattern's `step` group gives the step")
        return self

    def pattern(self) -> re.Pattern[str]:
        """The compiled pattern (the regex, or the preset's)."""
        return re.compile(self.regex if self.regex is not None
                          else PRESETS[self.preset or ""].regex)


def pattern_errors(regex: str) -> None:
    """ValueError saying what is wrong with a user's progress regex."""
    try:
        compiled = re.compile(regex)
    except re.error as e:
        raise ValueError(f"does not compile: {e}") from None
    names = set(compiled.groupindex)
    if "step" not in names:
        raise ValueError(r"must name a group `step`, as in 'step[: ]+(?P<step>\d+)'")
    unknown = sorted(names - set(GROUPS))
    if unknown:
        raise ValueError(f"names group(s) {', '.join(unknown)}: the groups are"
                         f" {', '.join(GROUPS)}")
