"""Hugging Face configs read into a spec's model (`service.contract.hf_config`): Llama (with
`llama3`, `linear` and `yarn` RoPE scaling from transformers 5's `rope_parameters` or
transformers 4's `rope_scaling`, attention and MLP biases, its own `head_dim`), Mistral,
Qwen2, Qwen3 (q/k norms, `head_dim`) and GPT-2, counted and built with exactly the parameters
of the `transformers` model; a field the trainer cannot honour is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from api.app import create_app
from service.contract import hf_config
from service.contract.hf_config import HfConfigError, model_fields
from service.contract.spec import JobSpec, ModelSpec
from service.files.checkpoint_dirs import CheckpointPlaces
from service.planner.shape import ModelShape
from service.settings import Settings
from service.store import Store
from tests.conftest import tiny_spec, user_token
from workers.modeling.model import GPT

LLAMA = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
         "max_position_embeddings": 32}


def built(fields: dict) -> int:
    return sum(p.numel() for p in GPT(ModelShape.from_spec(ModelSpec(**fields)), 0).parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_a_llama_config_of_transformers_5_is_the_model_transformers_builds(tied):
    config = LlamaConfig(**LLAMA, rope_theta=500000.0, tie_word_embeddings=tied)
    d = config.to_dict()
    assert d["rope_parameters"]["rope_theta"] == 500000.0  # where transformers 5 writes it
    fields = model_fields(d)
    assert fields["rope_theta"] == 500000.0 and fields["tied"] is tied
    assert fields["kv_heads"] == 2 and fields["activation"] == "swiglu"
    shape = ModelShape.from_spec(ModelSpec(**fields))
    hf = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert shape.total_params == built(fields) == hf
    assert model_fields(d, seq_len=16)["seq_len"] == 16


def test_a_transformers_4_config_keeps_rope_theta_at_the_top():
    v4 = {"model_type": "llama", **LLAMA, "rope_theta": 1e6, "rope_scaling": None,
          "hidden_act": "silu", "tie_word_embeddings": False}
    assert model_fields(v4)["rope_theta"] == 1e6
    assert model_fields({**v4, "rope_theta": None})["rope_theta"] == 10000.0


def test_a_gpt2_config_with_exact_gelu_is_the_model_transformers_builds():
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                        activation_function="gelu", bos_token_id=0, eos_token_id=0)
    fields = model_fields(config.to_dict())
    assert fields["tied"] and fields["activation"] == "gelu"
    hf = sum(p.numel() for p in GPT2LMHeadModel(config).parameters())
    assert ModelShape.from_spec(ModelSpec(**fields)).total_params == built(fields) == hf


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    "llama3": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA, rope_parameters=LLAMA3_ROPE)),
    "llama-biases": lambda: LlamaForCausalLM(LlamaConfig(
        **LLAMA, head_dim=32, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**LLAMA, sliding_window=None)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**LLAMA, head_dim=8,
                                                  tie_word_embeddings=True)),
    "qwen3-biases": lambda: Qwen3ForCausalLM(Qwen3Config(**LLAMA, attention_bias=True)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_config_is_counted_and_built_as_transformers_builds_it(family):
    hf = FAMILIES[family]()
    fields = model_fields(hf.config.to_dict())
    shape = ModelShape.from_spec(ModelSpec(**fields))
    assert shape.head_dim == hf.config.head_dim
    assert shape.qk_norm is (family.startswith("qwen3"))
    assert shape.tied is hf.config.tie_word_embeddings
    count = sum(p.numel() for p in hf.parameters())
    assert shape.total_params == built(fields) == count, family


@pytest.mark.parametrize("config, scaling", [
    ({**LLAMA, "rope_parameters": LLAMA3_ROPE},  # transformers 5
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}),
    ({**LLAMA, "rope_theta": 5e5, "rope_scaling": {  # transformers 4 (Llama 3.1's file)
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}},
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}),
    ({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}},  # transformers 4's `type`
     {"rope_type": "linear", "factor": 2.0}),
    ({**LLAMA, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                   "original_max_position_embeddings": 8}},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}),
    ({**LLAMA, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                   "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16}},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
      "beta_fast": 16.0, "beta_slow": 1.0, "truncate": True,
      # DeepSeek's: (0.1 ln 4 + 1) / (0.05 ln 4 + 1)
      "attention_factor": pytest.approx(1.1386294 / 1.0693147)}),
])
def test_rope_scaling_is_read_from_either_transformers_version(config, scaling):
    fields = model_fields({"model_type": "llama", **config})
    assert fields["rope_scaling"] == scaling
    assert fields["rope_theta"] == (config.get("rope_parameters") or config).get(
        "rope_theta", 10000.0)
    spec = ModelSpec(**fields)
    assert spec.rope_scaling is not None and spec.rope_scaling.rope_type == scaling["rope_type"]


def test_yarns_attention_factor_defaults_as_transformers_computes_it():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from workers.modeling.positions import inverse_frequencies

    config = LlamaConfig(**LLAMA, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                    "factor": 4.0,
                                                    "original_max_position_embeddings": 8})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    shape = ModelShape.from_spec(ModelSpec(**model_fields(config.to_dict())))
    assert shape.rope is not None and shape.rope.attention_scaling == pytest.approx(factor)
    assert torch.allclose(inverse_frequencies(shape.head_dim, 1e4, shape.rope), inv)
    for kind, params in (("llama3", LLAMA3_ROPE),
                         ("linear", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})):
        config = LlamaConfig(**LLAMA, rope_parameters=params)
        inv, _ = ROPE_INIT_FUNCTIONS[kind](config)
        shape = ModelShape.from_spec(ModelSpec(**model_fields(config.to_dict())))
        ours = inverse_frequencies(shape.head_dim, shape.rope_theta, shape.rope)
        assert torch.allclose(ours, inv) and not torch.allclose(
            ours, inverse_frequencies(shape.head_dim, shape.rope_theta, None)), kind


@pytest.mark.parametrize("config, field", [
    ({"model_type": "llama", **LLAMA, "rope_parameters": {"rope_type": "dynamic",
                                                          "rope_theta": 5e5, "factor": 2.0}},
     "rope_parameters.rope_type"),
    ({"model_type": "llama", **LLAMA, "rope_scaling": {"type": "longrope", "factor": 2.0}},
     "rope_scaling.rope_type"),
    ({"model_type": "llama", **LLAMA, "rope_parameters": {"rope_type": "linear"}},
     "rope_parameters.factor"),
    ({"model_type": "llama", **LLAMA, "rope_parameters": {"rope_type": "default",
                                                          "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor"),
    ({"model_type": "llama", **LLAMA, "rope_parameters": {
        "full_attention": {"rope_type": "default"}}}, "rope_parameters"),
    ({"model_type": "llama", **LLAMA, "hidden_act": "gelu"}, "hidden_act"),
    ({**Qwen2Config(**LLAMA, use_sliding_window=True, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]).to_dict()},
     "layer_types"),
    ({**MistralConfig(**LLAMA, sliding_window=0).to_dict()}, "sliding_window"),
    ({"model_type": "falcon", **LLAMA}, "model_type"),
    ({"model_type": "gemma", **LLAMA, "head_dim": 16, "hidden_act": "gelu_pytorch_tanh"},
     "model_type"),
    ({**GPT2Config(n_layer=1, n_embd=64, n_head=4, activation_function="relu").to_dict()},
     "activation_function"),
    ({**GPT2Config(n_layer=1, n_embd=64, n_head=4,
                   scale_attn_by_inverse_layer_idx=True).to_dict()},
     "scale_attn_by_inverse_layer_idx"),
])
def test_a_field_the_trainer_cannot_honour_is_refused_by_name(config, field):
    with pytest.raises(HfConfigError) as err:
        model_fields(config)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")
    if config["model_type"] == "gemma":  # says what it lacks
        assert "sqrt(hidden_size)" in str(err.value) and "(1 + weight)" in str(err.value)


def test_qwen3_slides_as_qwen2_does_only_with_use_sliding_window():
    config = Qwen3Config(**LLAMA, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    fields = model_fields(config.to_dict())
    assert (fields["sliding_window"], fields["full_attention_layers"]) == (8, 1)
    assert "sliding_window" not in model_fields(Qwen3Config(**LLAMA, sliding_window=8).to_dict())


def test_a_spec_names_what_a_rope_scaling_lacks(store: Store, tmp_path: Path):
    settings = Settings(data_dir=tmp_path / "data", checkpoint_roots=str(tmp_path))
    with TestClient(create_app(settings, store=store)) as c:
        c.headers["Authorization"] = f"Bearer {user_token(store, 'alice', 'member')}"
        spec = tiny_spec()
        for scaling, loc in (({"rope_type": "llama3", "factor": 8.0}, "original_max_position_"
                                                                       "embeddings"),
                             ({"rope_type": "ntk", "factor": 8.0}, "rope_type"),
                             ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4,
                               "original_max_position_embeddings": 8}, "high_freq_factor")):
            model = {**spec["model"], "activation": "swiglu", "rope_scaling": scaling}
            r = c.post("/api/v1/jobs", json={**spec, "model": model})
            assert r.status_code == 422, r.text
            assert loc in r.text and "rope_scaling" in r.text, r.text
        model = {**spec["model"], "activation": "swiglu", "rope_theta": 5e5,
                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                  "original_max_position_embeddings": 8}}
        r = c.post("/api/v1/jobs", json={**spec, "model": model})
        assert r.status_code == 201, r.text
        got = JobSpec.model_validate(r.json()["spec"]).model
        assert got.rope_scaling is not None and got.rope_scaling.high_freq_factor == 4.0


def test_the_llama3_presets_carry_their_rope():
    for preset, factor in (("llama3-8b", None), ("llama3.1-8b", 8.0), ("llama3-405b", 8.0),
                           ("llama3.2-1b", 32.0), ("llama3.3-70b", 8.0)):
        spec = ModelSpec(preset=preset)
        assert spec.rope_theta == 500000.0, preset
        if factor is None:
            assert spec.rope_scaling is None
        else:
            assert spec.rope_scaling is not None and spec.rope_scaling.factor == factor
            assert spec.rope_scaling.rope_type == "llama3"
            assert spec.rope_scaling.original_max_position_embeddings == 8192
    assert ModelShape.from_spec(ModelSpec(preset="llama3.2-1b")).tied
    assert ModelSpec(preset="llama3.1-8b", rope_theta=1e6).rope_theta == 1e6  # overridden


def test_the_rope_base_reaches_the_rotary_positions():
    from workers.modeling.positions import rotary

    x = torch.randn(1, 1, 8, 16)
    assert not torch.allclose(rotary(x, 10000.0), rotary(x, 500000.0))
    fields = model_fields(LlamaConfig(**LLAMA, rope_theta=500000.0).to_dict())
    assert ModelShape.from_spec(ModelSpec(**fields)).rope_theta == 500000.0


def test_qwen2_and_gpt2s_tanh_gelu_are_the_models_transformers_builds():
    qwen = Qwen2Config(**LLAMA, tie_word_embeddings=True)
    fields = model_fields(qwen.to_dict())
    assert fields["qkv_bias"] and fields["norm_eps"] == qwen.rms_norm_eps
    hf = sum(p.numel() for p in Qwen2ForCausalLM(qwen).parameters())
    assert ModelShape.from_spec(ModelSpec(**fields)).total_params == built(fields) == hf
    gpt2 = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    assert gpt2.activation_function == "gelu_new"
    fields = model_fields(gpt2.to_dict())
    assert fields["activation"] == "gelu_tanh" and fields["norm_eps"] == 1e-5
    hf = sum(p.numel() for p in GPT2LMHeadModel(gpt2).parameters())
    assert ModelShape.from_spec(ModelSpec(**fields)).total_params == built(fields) == hf


def test_the_spec_field_reads_a_config_only_through_an_installed_reader(tmp_path: Path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LlamaConfig(**LLAMA).to_dict()))
    with pytest.raises(ValidationError, match="hf_config: no config can be read here"):
        ModelSpec(hf_config=str(path), seq_len=16)
    with hf_config.reading(hf_config.local_reader):
        m = ModelSpec(hf_config=str(tmp_path), seq_len=16)  # a folder: its config.json
    assert (m.layers, m.hidden, m.kv_heads, m.seq_len, m.activation) == (2, 64, 2, 16, "swiglu")
    # The stored spec holds the dimensions: validated again, nothing is read.
    assert ModelSpec.model_validate(m.model_dump()) == m
    with hf_config.reading(hf_config.confined_reader(
            CheckpointPlaces([tmp_path / "elsewhere"]).read_refusal)), \
            pytest.raises(ValidationError, match="outside the server's checkpoint roots"):
        ModelSpec(hf_config=str(path))


def test_a_submission_reads_hf_config_inside_the_checkpoint_roots_only(store: Store,
                                                                        tmp_path: Path):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    for d in (root, outside):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32).to_dict()))
    settings = Settings(data_dir=tmp_path / "data", checkpoint_roots=str(root))
    with TestClient(create_app(settings, store=store)) as c:
        c.headers["Authorization"] = f"Bearer {user_token(store, 'alice', 'member')}"
        spec = tiny_spec()
        r = c.post("/api/v1/jobs", json={**spec, "model": {"hf_config": str(root), "seq_len": 16},
                                         "init": {"from_hf": str(root)}})
        assert r.status_code == 201, r.text
        model = JobSpec.model_validate(r.json()["spec"]).model
        assert (model.layers, model.activation, model.seq_len) == (2, "gelu_tanh", 16)
        for body, loc in (({"model": {"hf_config": str(outside)}}, "model"),
                          ({"init": {"from_hf": str(outside)}}, "init")):
            r = c.post("/api/v1/jobs", json={**spec, **body})
            assert r.status_code == 422, r.text
            assert "outside the server's checkpoint roots" in r.text and loc in r.text
