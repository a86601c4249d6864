"""A Hugging Face `config.json` read into the model fields of a spec
(`service.contract.spec.ModelSpec`).

Families: `LlamaForCausalLM`, `MistralForCausalLM` (SwiGLU, RMSNorm, rotary, grouped-query
attention, tied or untied head), `Qwen2ForCausalLM` (Llama with biases on q, k and v:
`qkv_bias`) and `GPT2LMHeadModel` (GELU, exact or tanh-approximated `gelu_new`, LayerNorm,
learned positions, biases, tied head). The norms' epsilon is read into `norm_eps`. The
rotary base comes from `transformers` 5's `rope_parameters` (`{"rope_theta": ...,
"rope_type": "default"}`, with `rope_theta: null` at the top) or from
`transformers` 4's top-level `rope_theta`. A sliding window (Mistral's `sliding_window`,
Qwen2's with `use_sliding_window` from `max_window_layers`, or `layer_types`) is read into
`sliding_window` and `full_attention_layers`. A field the built-in trainer cannot honour is
refused naming it (`HfConfigError.field`): RoPE scaling, a head size other than hidden / heads,
partial biases (`attention_bias`, `mlp_bias`), `layer_types` that mix sliding and full layers
in another order than full first, an activation other than the family's, GPT-2's attention
variants (`scale_attn_by_inverse_layer_idx`, `reorder_and_upcast_attn`).

The spec field `model.hf_config: PATH` reads a config through `read_fields`, with the reader
the caller installs (`reading`): the API's submission route reads inside the server's
checkpoint roots only, where a job's checkpoint folder may be read (`confined_reader`: not the
data directory, not another job's folder), off its event loop and within a time limit, before
the body is validated (`api.deps.read_hf_configs`, which installs the config it read:
`prepared`); the CLI reads the local file. Only a regular file is read, of at most
`TRIDENT_SPEC_FILE_MAX_BYTES` (`service.contract.specfiles`), and JSON nested deeper than Python's
parser goes is refused as any other malformed config is. With no reader installed a spec naming a
config without its dimensions is refused (a worker re-validating a stored spec never reads:
the stored spec holds the dimensions read at submission).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from service.contract.specfiles import read_regular

MAX_CONFIG_BYTES = 1 << 20
"""The largest `config.json` read by default (1 MiB; real ones are a few KiB): the API's is
`TRIDENT_SPEC_FILE_MAX_BYTES`."""
DIMENSIONS = ("layers", "hidden", "heads", "vocab")
"""A model's fields without which its `hf_config` is read."""

Reader = Callable[[str], dict[str, Any]]
"""`reader(path)`: the parsed config at `path`, or ValueError saying why not."""
_READER: ContextVar[Reader | None] = ContextVar("hf_config_reader", default=None)


@contextmanager
def reading(reader: Reader) -> Iterator[None]:
    """Specs validated inside this block may read `model.hf_config` through `reader`."""
    token = _READER.set(reader)
    try:
        yield
    finally:
        _READER.reset(token)


def install(reader: Reader) -> None:
    """Install `reader` for the rest of the current context (an async dependency's caller:
    FastAPI validates the body in the context its dependencies ran in)."""
    _READER.set(reader)


def wanted(model: Any) -> str | None:
    """The `config.json` that validating the model fields `model` (a spec's `model`, as
    given) reads: its `hf_config` when a dimension is missing; None when nothing is read."""
    if not isinstance(model, dict) or not isinstance(model.get("hf_config"), str):
        return None
    if all(k in model for k in DIMENSIONS):
        return None
    return config_path(model["hf_config"])


def config_path(raw: str) -> str:
    """`raw`, a `config.json` or a folder holding one: the file."""
    return raw if raw.endswith(".json") else os.path.join(raw, "config.json")


def _parse(path: str, max_bytes: int = MAX_CONFIG_BYTES, limit_name: str = "") -> dict[str, Any]:
    try:
        raw = read_regular(path, max_bytes, limit_name)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    try:
        config = json.loads(raw)
    except ValueError:
        raise ValueError(f"{path}: not JSON") from None
    except RecursionError:  # "[[[[..." a million deep: the parser's limit, not a 500
        raise ValueError(f"{path}: JSON nested deeper than the parser reads; not a"
                         " config.json") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def local_reader(path: str) -> dict[str, Any]:
    """Any local regular file (the CLI: the user's own files)."""
    return _parse(path)


def folder_of(path: str) -> str:
    """The folder a `model.hf_config` reads from (`path`, or the folder of its `.json`)."""
    return os.path.dirname(path) if path.endswith(".json") else path


def confined_reader(refusal: Callable[[str], str | None], max_bytes: int = MAX_CONFIG_BYTES,
                    limit_name: str = "") -> Reader:
    """A reader of configs in the folders a job may read (`refusal(folder)`: why not; the
    API's is `service.files.checkpoint_dirs.CheckpointPlaces.read_refusal`: inside the server's
    checkpoint roots, not the data directory, not another job's folder), of at most
    `max_bytes` (`limit_name`: the setting that says so)."""
    def read(path: str) -> dict[str, Any]:
        if why := refusal(folder_of(path)):
            raise ValueError(why)
        return _parse(path, max_bytes, limit_name)
    return read


def prepared(found: dict[str, dict[str, Any] | ValueError]) -> Reader:
    """A reader that reads nothing: the configs `found` holds by path (each one read
    already, or why it could not be); a path it lacks is refused."""
    def read(path: str) -> dict[str, Any]:
        got = found.get(path)
        if got is None:
            raise ValueError(f"{path}: not read at submission")
        if isinstance(got, ValueError):
            raise got
        return got
    return read


def read_fields(path: str, seq_len: Any = None) -> dict[str, Any]:
    """The ModelSpec fields of the config at `path` (a `config.json`, or a folder holding
    one), read with the installed reader; ValueError naming why not."""
    reader = _READER.get()
    if reader is None:
        raise ValueError("hf_config: no config can be read here; submit the spec to the"
                         " server (which reads it inside its checkpoint roots) or give the"
                         " dimensions")
    path = config_path(path)
    try:
        return model_fields(reader(path), seq_len if isinstance(seq_len, int) else None)
    except HfConfigError as exc:
        raise ValueError(f"hf_config: {path}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"hf_config: {exc}") from None
    except (KeyError, TypeError) as exc:
        raise ValueError(f"hf_config: {path}: missing or malformed field {exc}") from None

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
"""`model_type`s read as Llama (Mistral is Llama with a sliding window, Qwen2 Llama with
biases on q, k and v, Qwen3 Llama with per-head q/k norms and its own head size)."""
REFUSED_FAMILIES = {
    "gemma": "Gemma multiplies the embeddings by sqrt(hidden_size), its RMSNorms scale by"
             " (1 + weight) and its MLP is GeGLU (gelu_pytorch_tanh gating): the trainer"
             " builds none of the three",
    "gemma2": "Gemma 2 adds logit soft-capping, sandwich norms and alternating sliding"
              " windows to Gemma's scaled embeddings, (1 + weight) norms and GeGLU: none built",
    "gemma3_text": "Gemma 3 adds q/k norms with (1 + weight), sandwich norms and local/global"
                   " rotary bases to Gemma's scaled embeddings and GeGLU: none built",
}
"""Families close to Llama that are refused, and why (docs/models.md)."""
ROPE_KINDS = ("default", "linear", "llama3", "yarn")
"""The `rope_type`s built (`service.planner.shape.RopeScaling`)."""


class HfConfigError(ValueError):
    """A config field the trainer cannot honour, named."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def model_fields(config: dict[str, Any], seq_len: int | None = None) -> dict[str, Any]:
    """The ModelSpec fields of `config` (a parsed `config.json`); `seq_len` defaults to its
    `max_position_embeddings` (`n_positions` for GPT-2)."""
    kind = config.get("model_type")
    if kind in LLAMA_LIKE:
        return _llama(config, seq_len)
    if kind == "gpt2":
        return _gpt2(config, seq_len)
    if kind in REFUSED_FAMILIES:
        raise HfConfigError("model_type", f"{kind!r} is not built: {REFUSED_FAMILIES[kind]}")
    raise HfConfigError("model_type", f"{kind!r} is not a family the trainer builds; known:"
                        f" {', '.join([*LLAMA_LIKE, 'gpt2'])}")


def _rope_dict(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The rotary parameters and the field they came from: transformers 5's
    `rope_parameters`, else transformers 4's `rope_scaling` (`type` or `rope_type`)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params:
        if any(isinstance(v, dict) for v in params.values()):
            raise HfConfigError("rope_parameters", "rotary parameters per layer type are not"
                                " built")
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = config.get("rope_scaling")
        if kind == "default" and isinstance(scaling, dict) and scaling:
            return "rope_scaling", scaling  # a 4-style config whose 5-style part is default
        return "rope_parameters", params
    scaling = config.get("rope_scaling")
    return "rope_scaling", scaling if isinstance(scaling, dict) else {}


def rope_theta(config: dict[str, Any]) -> float:
    """The RoPE base: `rope_parameters.rope_theta` (transformers 5) or `rope_theta` (4)."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        theta = config.get("rope_theta")
    return float(theta) if theta is not None else 10000.0


def rope_scaling(config: dict[str, Any]) -> dict[str, Any] | None:
    """The spec's `rope_scaling` of `config` (None: the default kind), completed as
    `transformers` completes it (`standardize_rope_params`, `_compute_yarn_parameters`):
    `original_max_position_embeddings` defaults to `max_position_embeddings`; yarn's
    `factor` to their ratio and its attention factor from `mscale` / `mscale_all_dim`.
    A kind not built is refused naming `<field>.rope_type`."""
    field, p = _rope_dict(config)
    kind = p.get("rope_type", p.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise HfConfigError(f"{field}.rope_type", f"{kind!r} RoPE scaling is not built; built:"
                            f" {', '.join(ROPE_KINDS)}")
    partial = p.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise HfConfigError(f"{field}.partial_rotary_factor", f"{partial}: rotary positions"
                            " over part of each head are not built")
    if kind == "default":
        return None
    original = config.get("original_max_position_embeddings",
                          p.get("original_max_position_embeddings",
                                config.get("max_position_embeddings")))
    factor = p.get("factor")
    if factor is None and kind == "yarn" and original:
        factor = config["max_position_embeddings"] / original
    if factor is None:
        raise HfConfigError(f"{field}.factor", f"{kind} RoPE scaling without its factor")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    if kind in ("llama3", "yarn"):
        if original is None:
            raise HfConfigError(f"{field}.original_max_position_embeddings",
                                f"{kind} RoPE scaling without the pretraining context")
        out["original_max_position_embeddings"] = int(original)
    if kind == "llama3":
        out["low_freq_factor"] = float(p["low_freq_factor"])
        out["high_freq_factor"] = float(p["high_freq_factor"])
    if kind == "yarn":
        out["beta_fast"] = float(p.get("beta_fast") or 32)
        out["beta_slow"] = float(p.get("beta_slow") or 1)
        out["truncate"] = bool(p.get("truncate", True))
        attention = p.get("attention_factor")
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if attention is None and mscale and mscale_all:
            attention = _yarn_mscale(float(factor), mscale) / _yarn_mscale(float(factor),
                                                                           mscale_all)
        if attention is not None:
            out["attention_factor"] = float(attention)
    return out


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama(c: dict[str, Any], seq_len: int | None) -> dict[str, Any]:
    kind = c["model_type"]
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    if c.get("hidden_act", "silu") != "silu":
        raise HfConfigError("hidden_act", f"{c['hidden_act']!r}: the trainer's gated MLP is"
                            " SwiGLU (silu)")
    head_dim = c.get("head_dim")
    if head_dim is not None and int(head_dim) * heads == hidden:
        head_dim = None  # the default size, said explicitly (transformers 5 writes it)
    seq = seq_len or int(c["max_position_embeddings"])
    out = {**sliding_window(c),
           "layers": int(c["num_hidden_layers"]), "hidden": hidden, "heads": heads,
           "kv_heads": int(c.get("num_key_value_heads") or heads),
           "vocab": int(c["vocab_size"]), "seq_len": seq,
           "ffn_hidden": int(c["intermediate_size"]), "activation": "swiglu",
           "tied": bool(c.get("tie_word_embeddings", False)), "rope_theta": rope_theta(c),
           "qkv_bias": kind == "qwen2", "qk_norm": kind == "qwen3",
           "attention_bias": kind != "qwen2" and bool(c.get("attention_bias", False)),
           "mlp_bias": bool(c.get("mlp_bias", False)),
           "norm_eps": float(c.get("rms_norm_eps", 1e-6))}
    if head_dim is not None:
        out["head_dim"] = int(head_dim)
    if (scaling := rope_scaling(c)) is not None:
        out["rope_scaling"] = scaling
    return out


def sliding_window(c: dict[str, Any]) -> dict[str, Any]:
    """`sliding_window` and `full_attention_layers` as `transformers` builds them: Mistral
    slides in every layer when `sliding_window` is set; Qwen2 only with `use_sliding_window`,
    from layer `max_window_layers` on; a `layer_types` list (transformers 5 writes it) says it
    layer by layer, and must be full layers first, then sliding ones."""
    window = c.get("sliding_window")
    layers = int(c["num_hidden_layers"])
    if c["model_type"] in ("qwen2", "qwen3") and not c.get("use_sliding_window", False):
        window = None  # Qwen keeps the field but slides only with use_sliding_window
    if window is None:
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise HfConfigError("sliding_window", f"{window!r} is not a positive whole number")
    full = int(c.get("max_window_layers", 0)) if c["model_type"] in ("qwen2", "qwen3") else 0
    types = c.get("layer_types")
    if isinstance(types, list):
        full = sum(1 for t in types if t == "full_attention")
        if types != ["full_attention"] * full + ["sliding_attention"] * (len(types) - full):
            raise HfConfigError("layer_types", "the trainer builds full-attention layers"
                                " first, then sliding-window ones; this order is not built")
    return {"sliding_window": window, "full_attention_layers": min(full, layers)}


def _gpt2(c: dict[str, Any], seq_len: int | None) -> dict[str, Any]:
    act = c.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise HfConfigError("activation_function", f"{act!r}: the trainer's GELUs are"
                            f" {', '.join(GPT2_ACTIVATIONS)}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if c.get(flag):
            raise HfConfigError(flag, "this attention variant is not built")
    if c.get("scale_attn_weights", True) is False:
        raise HfConfigError("scale_attn_weights", "the trainer scales attention by"
                            " 1/sqrt(head size)")
    hidden = int(c["n_embd"])
    return {"layers": int(c["n_layer"]), "hidden": hidden, "heads": int(c["n_head"]),
            "vocab": int(c["vocab_size"]), "seq_len": seq_len or int(c["n_positions"]),
            "ffn_hidden": int(c.get("n_inner") or 4 * hidden),
            "activation": GPT2_ACTIVATIONS[act],
            "tied": bool(c.get("tie_word_embeddings", True)),
            "norm_eps": float(c.get("layer_norm_epsilon", 1e-5))}


GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
"""GPT-2's `activation_function`s the trainer builds: exact GELU, and the tanh form."""
