"""Hugging Face configs read into a spec's model (`service.contract.hf_config`): Llama and Mistral
(transformers 5's `rope_parameters` and transformers 4's top-level `rope_theta`) and GPT-2,
counted and built with exactly the parameters of the `transformers` model; a field the trainer
cannot honour is refused by name."""

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
    Qwen2Config,
    Qwen2ForCausalLM,
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


@pytest.mark.parametrize("config, field", [
    ({"model_type": "llama", **LLAMA, "rope_parameters": {"rope_type": "llama3",
                                                          "rope_theta": 5e5}},
     "rope_parameters.rope_type"),
    ({"model_type": "llama", **LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope_scaling.rope_type"),
    ({"model_type": "llama", **LLAMA, "head_dim": 32}, "head_dim"),
    ({"model_type": "llama", **LLAMA, "attention_bias": True}, "attention_bias"),
    ({"model_type": "llama", **LLAMA, "hidden_act": "gelu"}, "hidden_act"),
    ({**Qwen2Config(**LLAMA, use_sliding_window=True, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]).to_dict()},
     "layer_types"),
    ({**MistralConfig(**LLAMA, sliding_window=0).to_dict()}, "sliding_window"),
    ({"model_type": "falcon", **LLAMA}, "model_type"),
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


def test_the_rope_base_reaches_the_rotary_positions():
    from workers.modeling.model import rotary

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
