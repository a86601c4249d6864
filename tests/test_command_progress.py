"""A command job's progress: the `progress:` spec, the lines of the trainers' presets as those
programs print them, and the report file's lines.

Each preset's lines are built with the format string of the program's own source (cited
beside it); the Hugging Face Trainer's are also printed by a real Trainer in
tests/test_command_scripts.py.
"""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.contract.command import PRESETS, ProgressSpec
from workers.command.progress import ProgressReader, read_report_lines, report_line

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# --- the spec -------------------------------------------------------------------------------

def test_regex_or_preset_exactly_one() -> None:
    assert ProgressSpec(preset="megatron").rank == 0
    assert ProgressSpec.model_validate({"regex": r"step (?P<step>\d+)", "rank": 3}).rank == 3
    with pytest.raises(ValidationError, match="exactly one of `regex` and `preset` .got neither"):
        ProgressSpec.model_validate({})
    with pytest.raises(ValidationError, match="exactly one of `regex` and `preset` .got both"):
        ProgressSpec.model_validate({"regex": r"(?P<step>\d+)", "preset": "torchtitan"})


@pytest.mark.parametrize(("regex", "match"), [
    ("step (\\d+)", "must name a group `step`"),
    ("(?P<step>\\d+", "does not compile"),
    ("(?P<step>\\d+) (?P<losss>\\S+)", r"names group\(s\) losss: the groups are step, loss"),
    ("x" * 1001, "at most 1000 characters"),
])
def test_bad_regex_names_the_field(regex: str, match: str) -> None:
    with pytest.raises(ValidationError, match=match) as e:
        ProgressSpec.model_validate({"regex": regex})
    assert e.value.errors()[0]["loc"] == ("regex",)


@pytest.mark.parametrize("bad", [{"preset": "deepspeed"}, {"preset": "megatron", "rank": -1},
                                 {"preset": "megatron", "rank": "0"},
                                 {"preset": "megatron", "other": 1},
                                 {"preset": "megatron", "logging_steps": 5}])
def test_strict_fields(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ProgressSpec.model_validate(bad)


def test_schema_carries_the_limits() -> None:
    props = ProgressSpec.model_json_schema()["properties"]
    assert props["rank"]["minimum"] == 0 and props["rank"]["maximum"] == 65535
    assert props["regex"]["anyOf"][0]["maxLength"] == 1000
    assert props["logging_steps"]["minimum"] == 1


def test_own_regex() -> None:
    spec = ProgressSpec(regex=r"step[: ]+(?P<step>\d+).*loss[: ]+(?P<loss>[0-9.e+-]+)")
    r = ProgressReader(spec)
    assert r.feed("epoch 0 step: 12 loss: 3.5e-1") == {"step": 12, "loss": 0.35}
    assert r.feed("loading shards...") is None
    assert r.feed("step: 0 loss: 1") is None  # steps are 1-based
    assert r.matched == 1


# --- the presets, against the lines of their programs' sources -----------------------------

class _Color:
    """torchtitan's `Color` (pytorch/torchtitan torchtitan/tools/utils.py): ANSI escapes."""

    red, green, yellow, blue = "\033[31m", "\033[32m", "\033[33m", "\033[34m"
    magenta, cyan, reset = "\033[35m", "\033[36m", "\033[39m"
    orange, turquoise = "\033[38;2;180;60;0m", "\033[38;2;54;234;195m"


def _torchtitan_line(step: int, global_avg_loss: float, grad_norm: float, tps: float,
                     mfu: float | None = None) -> str:
    # pytorch/torchtitan torchtitan/components/metrics.py, MetricsProcessor.log (torchtitan
    # 0.3.0 on PyPI), behind the logger's prefix (torchtitan/tools/logging.py:
    # "[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s"). Without a known peak
    # FLOP/s for the device, mfu is "N/A".
    color, mem_gib, mem_pct, tflops = _Color, 1.07, 1.13, 0.09
    mfu_str = f"{mfu:.2f}%" if mfu is not None else "N/A"
    msg = (f"{color.red}step: {step:2}  "
           f"{color.green}loss: {global_avg_loss:8.5f}  "
           f"{color.orange}grad_norm: {grad_norm:7.4f}  "
           f"{color.turquoise}memory: {mem_gib:5.2f}GiB"
           f"({mem_pct:.2f}%)  "
           f"{color.blue}tps: {round(tps):,}  "
           f"{color.cyan}tflops: {tflops:,.2f}  "
           f"{color.magenta}mfu: {mfu_str}{color.reset}")
    return f"[titan] 2026-12-07 15:00:00,000 - root - INFO - {msg}"


def test_torchtitan_preset() -> None:
    r = ProgressReader(ProgressSpec(preset="torchtitan"), world_size=2)
    assert r.feed(_torchtitan_line(1, 12.25994, 1.3413, 12345.4, mfu=0.01)) == {
        "step": 1, "loss": 12.25994, "grad_norm": 1.3413, "tokens_per_s": 2 * 12345.0}
    got = r.feed(_torchtitan_line(10, float("nan"), float("nan"), 800))
    assert got is not None and got["step"] == 10 and math.isnan(got["loss"])
    assert "grad_norm" not in got  # a norm of nan is not measured
    # Its validation line (MetricsProcessor.log_validation) is not a training step.
    val = (f"{_Color.yellow}validate step: {10:2}  {_Color.green}loss: {7.25:7.4f}  "
           f"{_Color.turquoise}memory: {1.0:5.2f}GiB({1.0:.2f}%)  "
           f"{_Color.blue}tps: {round(512.0):,}{_Color.reset}")
    assert r.feed(val) is None


def test_torchtitan_preset_without_grad_norm() -> None:
    # Older torchtitan (pytorch/torchtitan torchtitan/train.py, before
    # torchtitan/components/metrics.py) printed no norm.
    line = (f"{_Color.red}step: {3:2}  {_Color.green}loss: {9.5:7.4f}  "
            f"{_Color.yellow}memory: {0.5:5.2f}GiB({0.5:.2f}%)  "
            f"{_Color.blue}tps: {round(1000.4):,}  {_Color.magenta}mfu: {0.0:.2f}%{_Color.reset}")
    assert ProgressReader(ProgressSpec(preset="torchtitan")).feed(line) == {
        "step": 3, "loss": 9.5, "tokens_per_s": 1000.0}


def _megatron_line(iteration: int, learning_rate: float | None, loss: float,
                   grad_norm: float | None) -> str:
    # NVIDIA/Megatron-LM megatron/training/training.py, training_log (the timestamp is
    # datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f'); ranks without trainable parameters
    # have no learning rate).
    log_string = " [2026-12-07 15:00:00.123456]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, 100)  # noqa: UP032
    log_string += ' consumed samples: {:12d} |'.format(iteration * 16)  # noqa: UP032
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(820.7)  # noqa: UP032
    if learning_rate is not None:
        log_string += f' learning rate: {learning_rate:.6E} |'
    log_string += f' global batch size: {16:5d} |'
    log_string += ' {}: {:.6E} |'.format("lm loss", loss)
    log_string += f' loss scale: {1.0:.1f} |'
    if grad_norm is not None:
        log_string += f' grad norm: {grad_norm:.3f} |'
    log_string += ' number of skipped iterations: {:3d} |'.format(0)  # noqa: UP032
    log_string += ' number of nan iterations: {:3d} |'.format(0)  # noqa: UP032
    return log_string


def test_megatron_preset() -> None:
    r = ProgressReader(ProgressSpec(preset="megatron"))
    assert r.feed(_megatron_line(10, 4e-5, 10.72453, 2.918)) == {
        "step": 10, "lr": 4e-5, "loss": 10.72453, "grad_norm": 2.918}
    assert r.feed(_megatron_line(20, None, 9.5, None)) == {"step": 20, "loss": 9.5}
    # The first iterations of an fp16 run, skipped while the loss scale settles, add no loss
    # to the interval's: the line has none, and gives no step report.
    skipped = _megatron_line(5, 0.0, 1.0, None).replace(" lm loss: 1.000000E+00 |", "")
    assert r.feed(skipped) is None
    # Megatron-LM's training_log of today prints every loss key, its sum over the interval's
    # advanced iterations divided by max(1, their count): 0 when every one was skipped. The
    # step is reported without a loss, not with a loss of 0.
    assert r.feed(_megatron_line(30, 4e-5, 0.0, None)) == {"step": 30, "lr": 4e-5}
    assert ProgressReader(ProgressSpec(regex=r"step (?P<step>\d+) loss (?P<loss>\S+)")).feed(
        "step 3 loss 0.0") == {"step": 3, "loss": 0.0}  # a pattern of your own: as printed


def test_hf_trainer_preset_counts_its_lines() -> None:
    # huggingface/transformers src/transformers/trainer_callback.py: PrinterCallback prints
    # the log dict with its floats as f"{v:.4g}" (transformers >= 5), ProgressCallback writes
    # str() of the same through tqdm; older versions printed the floats themselves.
    logs = {"loss": 2.3026, "grad_norm": 1.2345678, "learning_rate": 5e-05, "epoch": 0.5}
    new = str({k: f"{v:.4g}" for k, v in logs.items()})
    old = str(logs)
    r = ProgressReader(ProgressSpec(preset="hf-trainer", logging_steps=10))
    assert r.feed("\r 33%|███▎      | 10/30 [00:01<00:02]\r" + new) == {
        "step": 10, "loss": 2.303, "grad_norm": 1.235, "lr": 5e-05}
    assert r.feed(old) == {"step": 20, "loss": 2.3026, "grad_norm": 1.2345678, "lr": 5e-05}
    # The summary at the end (`train_loss`) and evaluations (`eval_loss`) are not steps.
    assert r.feed(str({"train_runtime": "1.5", "train_loss": "2.3", "epoch": "1"})) is None
    assert r.feed(str({"eval_loss": "2.1", "epoch": "1"})) is None
    assert r.matched == 2
    # An attempt that resumed from its checkpoint of step 30 logs from step 40 on.
    resumed = ProgressReader(ProgressSpec(preset="hf-trainer", logging_steps=10), resume_step=30)
    assert resumed.feed(new) == {"step": 40, "loss": 2.303, "grad_norm": 1.235, "lr": 5e-05}


def test_presets_cite_their_source() -> None:
    assert {p.source.split()[0] for p in PRESETS.values()} == {
        "pytorch/torchtitan", "huggingface/transformers", "NVIDIA/Megatron-LM"}


# --- the report file ------------------------------------------------------------------------

def test_report_line_is_a_step_report() -> None:
    assert report_line('{"step": 3, "loss": 2.5, "memory": {"params_bytes": 1024},'
                       ' "comm": {"dp": {"all_reduce": {"time_s": 0.1, "bytes": 8,'
                       ' "calls": 1}}}, "custom": {"accuracy": 0.5}}') == {
        "step": 3, "loss": 2.5, "memory": {"params_bytes": 1024},
        "comm": {"dp": {"all_reduce": {"time_s": 0.1, "bytes": 8.0, "calls": 1.0}}},
        "custom": {"accuracy": 0.5}}
    assert report_line('{"step": 4, "loss": NaN}') == {
        "step": 4, "loss": None, "loss_nonfinite": True}


@pytest.mark.parametrize(("text", "why"), [
    ("[1, 2]", "not a JSON object: list"),
    ('{"step": 1', "not JSON"),
    ('{"loss": 1.0}', "step: Field required"),
    ('{"step": 0}', "step: Input should be greater than or equal to 1"),
    ('{"step": 1, "rank": 0}', "rank: set by Trident"),
    ('{"step": 1, "lossy": 1}', "lossy: Extra inputs are not permitted"),
    ('{"step": 1, "memory": {"params_bytes": -1}}', "memory.params_bytes: Input should be"),
    ('{"step": 1, "custom": {"loss": 1}}', "custom metric name 'loss' is taken"),
    ('{"step": 1, "bubble_s": 2, "step_time_s": 1}', "bubble_s .2.0. exceeds step_time_s"),
])
def test_bad_report_line_says_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as e:
        report_line(text)
    assert "\n" not in str(e.value)


def test_read_report_lines_reads_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "report.jsonl"
    assert read_report_lines(path, 0) == ([], 0)  # not written yet
    with path.open("w") as f:
        f.write(json.dumps({"step": 1, "loss": 3.0}) + "\n")
        f.write("not json\n\n")
        f.write(json.dumps({"step": 2, "loss": 2.0}) + "\n")
        f.write('{"step": 3, "lo')  # being written
    errors: list[str] = []
    reports, offset = read_report_lines(path, 0, errors)
    assert reports == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]
    assert errors == ["byte 25: not JSON: Expecting value: line 1 column 1 (char 0)"]
    assert read_report_lines(path, offset) == ([], offset)
    with path.open("a") as f:
        f.write('ss": 1.5}\n')
    assert read_report_lines(path, offset) == ([{"step": 3, "loss": 1.5}], path.stat().st_size)


def test_read_report_lines_started_again(tmp_path: Path) -> None:
    path = tmp_path / "report.jsonl"
    path.write_text('{"step": 1}\n')
    errors: list[str] = []
    assert read_report_lines(path, 1000, errors) == ([{"step": 1}], 12)
    assert len(errors) == 1 and "shorter (12 bytes)" in errors[0]


def test_read_report_lines_skips_an_endless_line(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.command.progress as progress
    monkeypatch.setattr(progress, "REPORT_READ_MAX", 64)
    path = tmp_path / "report.jsonl"
    path.write_text("x" * 100 + "\n" + '{"step": 7}\n')
    errors: list[str] = []
    reports, offset = read_report_lines(path, 0, errors)
    assert (reports, offset) == ([], 64) and "longer than 64 bytes" in errors[0]
    reports, offset = read_report_lines(path, offset, errors)
    assert reports == [{"step": 7}] and offset == path.stat().st_size
    assert len(errors) == 2  # the rest of the long line, as a bad line


def test_report_helper_writes_what_the_reader_reads(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    helper = runpy.run_path(str(EXAMPLES / "command" / "trident_report.py"))
    monkeypatch.delenv("TRIDENT_REPORT", raising=False)
    helper["report"](step=1, loss=3.0)  # outside Trident: nothing
    path = tmp_path / "r.jsonl"
    monkeypatch.setenv("TRIDENT_REPORT", str(path))
    helper["report"](step=1, loss=3.0, memory={"params_bytes": 4096})
    helper["report"](step=2, loss=float("nan"), custom={"accuracy": 0.25})
    errors: list[str] = []
    assert read_report_lines(path, 0, errors)[0] == [
        {"step": 1, "loss": 3.0, "memory": {"params_bytes": 4096}},
        {"step": 2, "loss": None, "loss_nonfinite": True, "custom": {"accuracy": 0.25}}]
    assert errors == []


def test_the_hf_trainer_example_spec_is_valid() -> None:
    import yaml

    from service.contract.spec import JobSpec

    spec = JobSpec.model_validate(yaml.safe_load(
        (EXAMPLES / "command" / "hf-trainer.yaml").read_text()))
    assert spec.command is not None and spec.command[1] == "hf_trainer.py"
    assert spec.progress == ProgressSpec(preset="hf-trainer") and spec.world_size == 2
