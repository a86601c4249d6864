"""Job spec validation: good specs pass, bad ones name the field and show the arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from service.contract.spec import JobSpec
from tests.conftest import tiny_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_tiny_example_is_valid() -> None:
    spec = JobSpec.model_validate(yaml.safe_load((EXAMPLES / "tiny.yaml").read_text()))
    assert spec.layout.dp == 2 and spec.layout.zero == 2
    assert spec.world_size == 2
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec  # stored form round-trips
    assert spec.model.layers == 4 and spec.model.ffn_hidden == 256


def test_preset_fields_can_be_overridden() -> None:
    spec = JobSpec.model_validate(tiny_spec(model={"preset": "gpt-tiny", "seq_len": 64}))
    assert spec.model.seq_len == 64 and spec.model.hidden == 64


def test_explicit_model_needs_all_dimensions() -> None:
    with pytest.raises(ValidationError, match="hidden, heads, vocab, seq_len required"):
        JobSpec.model_validate(tiny_spec(model={"layers": 2}))


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"parallel": {"tp": 3, "dp": 1}}, r"tp\(3\) does not divide heads\(4\)"),
        ({"parallel": {"pp": 5}}, r"layers\(4\) is fewer than pp\(5\)"),
        ({"parallel": {"pp": 2, "virtual_stages": 4}},
         r"pp\(2\) \* virtual_stages\(4\) = 8"),
        ({"parallel": {"dp": 3}}, r"global_batch\(8\) is not divisible by micro_batch\(2\)"
                                  r" \* dp\(3\) = 6"),
        ({"parallel": {"pp": 2, "zero": 2}}, r"zero\(2\) with pp\(2\)"),
        ({"parallel": {"pp": 2, "zero": 3}}, r"zero\(3\) with pp\(2\)"),
        ({"parallel": {"offload": "optimizer"}}, r"needs zero >= 1"),
        ({"parallel": {"zero": 2, "offload": "optimizer+params"}}, r"needs zero 3"),
        ({"parallel": {"sequence_parallel": True}}, r"sequence_parallel needs tp > 1"),
        ({"parallel": {"virtual_stages": 2}}, r"needs pp > 1"),
        ({"parallel": {"tp": 2, "pp": 2, "dp": 3},
          "train": {"global_batch": 12, "micro_batch": 1},
          "cluster": {"gpu": "a100-80gb", "nodes": 1, "gpus_per_node": 8}},
         r"tp\(2\) \* pp\(2\) \* dp\(3\) = 12 != world size 8"),
    ],
)
def test_inconsistent_layouts_are_rejected_with_arithmetic(over: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        JobSpec.model_validate(tiny_spec(**over))


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"bogus": 1}, "bogus"),
        ({"parallel": {"tp": 0}}, "tp"),
        ({"parallel": {"zero": 4}}, "zero"),
        ({"train": {"steps": 0}}, "steps"),
        ({"train": {"precision": "fp8"}}, "precision"),
        ({"model": {"preset": "gpt-tiny", "layers": 100000}}, "layers"),
        ({"model": {"preset": "nope"}}, "preset"),
        ({"cluster": {"gpu": "tpu-v9"}}, "gpu"),
        ({"env": {"1BAD": "x"}}, "env"),
        ({"name": "no spaces allowed"}, "name"),
        ({"entrypoint": "not a path"}, "entrypoint"),
        ({"resources": {"cpus_per_worker": 0}}, "cpus_per_worker"),
        ({"train": {"guard": {"on_spike": "ignore"}}}, "train.guard.on_spike"),
        ({"train": {"guard": {"spike_factor": 1.0}}}, "train.guard.spike_factor"),
        ({"train": {"guard": {"window": 0}}}, "train.guard.window"),
        ({"train": {"guard": {"max_skips": -1}}}, "train.guard.max_skips"),
        ({"faults": [{"kind": "spike", "rank": 0, "step": 1, "factor": 0}]}, "faults.0.factor"),
    ],
)
def test_bad_fields_are_named(over: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(tiny_spec(**over))
    locs = [".".join(str(p) for p in e["loc"]) for e in info.value.errors()]
    assert any(field in loc for loc in locs), locs


def test_every_field_is_documented() -> None:
    seen, todo = set(), [JobSpec]
    while todo:
        model = todo.pop()
        seen.add(model)
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no docstring"
            for arg in (info.annotation, *getattr(info.annotation, "__args__", ())):
                if isinstance(arg, type) and issubclass(arg, BaseModel) and arg not in seen:
                    todo.append(arg)
    assert len(seen) == 19  # JobSpec and the sections it reaches


def test_auto_layout_needs_a_cluster() -> None:
    with pytest.raises(ValidationError, match="parallel 'auto' needs a cluster"):
        JobSpec.model_validate(tiny_spec(parallel="auto"))
    spec = JobSpec.model_validate(tiny_spec(parallel="auto", cluster={"gpu": "cpu", "nodes": 1,
                                                                     "gpus_per_node": 2}))
    assert spec.world_size == 2
    assert spec.parallel == "auto"
    with pytest.raises(ValueError, match="auto"):
        _ = spec.layout


def test_a_validated_model_holds_plain_numbers_and_its_dump_round_trips() -> None:
    from service.contract.spec import ModelSpec

    stored = {"preset": "llama2-70b"}  # a spec stored before presets were merged on input
    model = ModelSpec.model_validate(stored)
    assert (model.layers, model.hidden, model.heads, model.kv_heads, model.ffn_hidden,
            model.activation) == (80, 8192, 64, 8, 28672, "swiglu")
    assert ModelSpec.model_validate(model.model_dump()) == model
    assert ModelSpec.model_validate_json(model.model_dump_json()) == model
    explicit = ModelSpec(layers=2, hidden=64, heads=4, vocab=128, seq_len=16)
    assert (explicit.kv_heads, explicit.ffn_hidden, explicit.activation) == (4, 256, "gelu")
    assert ModelSpec.model_validate(explicit.model_dump()) == explicit
    nulls = ModelSpec.model_validate({"preset": "gpt-tiny", "layers": None, "kv_heads": None})
    assert nulls == ModelSpec(preset="gpt-tiny")


def test_an_unknown_preset_is_the_only_error_reported() -> None:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(tiny_spec(model={"preset": "nope"}))
    assert [(e["loc"], e["msg"][:30]) for e in info.value.errors()] == [
        (("model", "preset"), "Value error, unknown preset 'n")]


@pytest.mark.parametrize(("model", "match"), [
    ({"preset": "gpt-tiny", "heads": 3}, r"hidden\(64\) is not divisible by heads\(3\)"),
    ({"preset": "gpt-tiny", "kv_heads": 3}, r"heads\(4\) is not divisible by kv_heads\(3\)"),
])
def test_model_dimensions_that_do_not_divide_are_rejected(model: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match) as info:
        JobSpec.model_validate(tiny_spec(model=model))
    assert [e["loc"] for e in info.value.errors()] == [("model",)]
