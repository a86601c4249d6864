"""Hugging Face weights in and out: the names and layouts of `transformers`' Llama, Mistral,
Qwen2, Qwen3 and GPT-2 checkpoints against the trainer's canonical full names
(`workers.checkpoint.full_state`).

In (`init.from_hf: PATH`, `load_init`): a folder with `model.safetensors`, or the shards its
`model.safetensors.index.json` names; every canonical tensor is a lazy view of the file's
tensor (`safetensors.safe_open(...).get_slice`), so that each rank reads only its TP shard of
the tensors of its pipeline stage.

Out (`to_hf_lazy`, `hf_config`, `write_hf`): the full tensors under Hugging Face's names, the
`config.json` that `transformers` builds the same model from, and safetensors files (sharded
above `max_shard_bytes`, with `model.safetensors.index.json`).

Layouts (from `transformers`' `modeling_llama.py`, `modeling_qwen2.py`, `modeling_gpt2.py`):

- Llama / Mistral / Qwen2 / Qwen3: `nn.Linear` weights (out, in), as the trainer's; `q_proj`,
  `k_proj`, `v_proj` (Qwen2, and `attention_bias`: with biases), `o_proj` (`attention_bias`:
  with its bias, the trainer's `o_bias`), Qwen3's `q_norm` and `k_norm` (one head_dim weight
  each), `gate_proj`, `up_proj`, `down_proj` (`mlp_bias`: with biases; down's is the
  trainer's `down_bias`), `input_layernorm`, `post_attention_layernorm`, `model.norm`,
  `lm_head` (absent when tied: the head reads `embed_tokens`).
  Rotary positions rotate the two halves of each head (`rotate_half`), as
  `workers.modeling.positions.rotary`
  does, so q and k load unpermuted (Meta's original checkpoints interleave the pairs; their
  conversion script permutes them into this layout).
- GPT-2: `Conv1D` weights are stored (in, out), the transpose of a linear's; `c_attn` holds q,
  k and v side by side (in, 3h); learned positions `wpe`; the head is tied to `wte`. Keys may
  carry the `transformer.` prefix (`GPT2LMHeadModel`) or not (`GPT2Model`, OpenAI's files).

Called by `workers.trainer.train` (`load_init`, once the model is built) and
`workers.checkpoint.hf_export`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from service.planner.shape import ModelShape
from workers.checkpoint.full_state import LazySlice, Sliceable, load_full
from workers.checkpoint.safetensors_out import write_safetensors
from workers.modeling.tp import RankGroups

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Above this many bytes the export writes several files (transformers' default, 5GB)."""


def family(shape: ModelShape) -> str:
    """The `transformers` family of `shape`: `llama`, `mistral` (Llama with a sliding window),
    `qwen2`, `qwen3` or `gpt2`; ValueError naming the trait no family has."""
    if shape.swiglu:
        if shape.layer_norm or shape.positions != "rotary" or shape.biases or shape.gelu_tanh:
            raise ValueError("model: a SwiGLU model with LayerNorm, learned positions or"
                             " biases on every layer is no Hugging Face family")
        if shape.qk_norm:
            if shape.mlp_bias or (shape.qkv_bias and not shape.attention_bias):
                raise ValueError("model: q/k norms with MLP biases or with biases on q, k"
                                 " and v only are no Hugging Face family (Qwen3 has neither)")
            return "qwen3"
        if shape.qkv_bias and not shape.attention_bias:
            if shape.mlp_bias:
                raise ValueError("model: biases on q, k, v and the MLP but not on the"
                                 " attention output are no Hugging Face family")
            return "qwen2"
        if shape.sliding_window is not None:
            if shape.full_attention_layers or shape.attention_bias or shape.mlp_bias:
                raise ValueError("model: a sliding window after full-attention layers, or"
                                 " with attention or MLP biases, is no Hugging Face family"
                                 " (Mistral slides in every layer and has no biases)")
            return "mistral"
        return "llama"
    if shape.sliding_window is not None:
        raise ValueError("model: GPT-2 has no sliding window")
    if not (shape.layer_norm and shape.positions == "learned" and shape.biases):
        raise ValueError("model: a GELU model without LayerNorm, learned positions and"
                         " biases (GPT-2's) is no Hugging Face family the export writes")
    return "gpt2"


def _llama_names(shape: ModelShape) -> dict[str, str]:
    """Canonical name -> Hugging Face name, Llama / Mistral / Qwen2 / Qwen3."""
    out = {"embed.tok": "model.embed_tokens.weight", "head.ln.weight": "model.norm.weight"}
    if not shape.tied:
        out["head.weight"] = "lm_head.weight"
    for i in range(shape.layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        out[p + "ln1.weight"] = hf + "input_layernorm.weight"
        out[p + "ln2.weight"] = hf + "post_attention_layernorm.weight"
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            out[f"{p}{ours}.weight"] = f"{hf}self_attn.{theirs}.weight"
            if shape.qkv_biased:
                out[f"{p}{ours}.bias"] = f"{hf}self_attn.{theirs}.bias"
        out[p + "o.weight"] = hf + "self_attn.o_proj.weight"
        if shape.o_biased:
            out[p + "o_bias"] = hf + "self_attn.o_proj.bias"
        if shape.qk_norm:
            out[p + "q_norm.weight"] = hf + "self_attn.q_norm.weight"
            out[p + "k_norm.weight"] = hf + "self_attn.k_norm.weight"
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            out[f"{p}{ours}.weight"] = f"{hf}mlp.{theirs}.weight"
            if shape.mlp_biased and ours != "down":
                out[f"{p}{ours}.bias"] = f"{hf}mlp.{theirs}.bias"
        if shape.mlp_biased:
            out[p + "down_bias"] = hf + "mlp.down_proj.bias"
    return out


# --- lazy views of a file's tensors --------------------------------------------------------------



class _Transposed:
    """The transpose of a 2-D source (GPT-2's Conv1D weights), read in part."""

    def __init__(self, source: Sliceable) -> None:
        self.source = source
        self.shape = tuple(reversed(tuple(source.shape)))

    def __getitem__(self, index: tuple[slice, slice]) -> torch.Tensor:
        return self.source[index[1], index[0]].t()


class _Narrowed:
    """`length` entries from `start` along `dim` of a source (q, k or v of GPT-2's c_attn)."""

    def __init__(self, source: Sliceable, dim: int, start: int, length: int) -> None:
        self.source, self.dim, self.start = source, dim, start
        shape = list(source.shape)
        shape[dim] = length
        self.shape = tuple(shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        full = list(index)
        s = full[self.dim]
        full[self.dim] = slice(self.start + (s.start or 0),
                               self.start + (self.shape[self.dim] if s.stop is None else s.stop))
        return self.source[tuple(full)]


Files = Callable[[str], "Sliceable | None"]
"""`tensor(hf_name)`: a lazy view of the checkpoint's tensor, None when it has none."""


def open_checkpoint(path: str) -> Files:
    """The tensors of the Hugging Face checkpoint folder `path` (`model.safetensors`, or the
    shards of `model.safetensors.index.json`), opened lazily."""
    from safetensors import safe_open

    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
    elif os.path.exists(os.path.join(path, SINGLE)):
        weight_map = {}
    else:
        raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX}")
    handles: dict[str, Any] = {}

    def handle(file: str) -> Any:
        if file not in handles:
            real = os.path.realpath(os.path.join(path, file))
            if os.path.dirname(real) != os.path.realpath(path):
                raise ValueError(f"{INDEX}: {file!r} is not a file of {path}")
            handles[file] = safe_open(real, framework="pt")
        return handles[file]

    def tensor(name: str) -> Sliceable | None:
        file = weight_map.get(name, SINGLE if not weight_map else None)
        if file is None:
            return None
        h = handle(file)
        if name not in h.keys():  # noqa: SIM118 (a safe_open handle is no dict)
            return None
        return LazySlice(h.get_slice(name))
    return tensor


def _gpt2_source(shape: ModelShape, files: Files) -> Callable[[str], Sliceable | None]:
    def hf(name: str) -> Sliceable | None:
        found = files("transformer." + name)
        return found if found is not None else files(name)

    h = shape.hidden
    simple = {"embed.tok": "wte.weight", "embed.pos": "wpe.weight",
              "head.ln.weight": "ln_f.weight", "head.ln.bias": "ln_f.bias"}

    def get(name: str) -> Sliceable | None:
        if name in simple:
            return hf(simple[name])
        if name == "head.weight":
            return files("lm_head.weight")
        _, i, rest = name.split(".", 2)
        p = f"h.{i}."
        local = {"ln1.weight": "ln_1.weight", "ln1.bias": "ln_1.bias",
                 "ln2.weight": "ln_2.weight", "ln2.bias": "ln_2.bias",
                 "o_bias": "attn.c_proj.bias", "up.bias": "mlp.c_fc.bias",
                 "down_bias": "mlp.c_proj.bias"}
        if rest in local:
            return hf(p + local[rest])
        conv = {"o.weight": "attn.c_proj.weight", "up.weight": "mlp.c_fc.weight",
                "down.weight": "mlp.c_proj.weight"}
        if rest in conv:
            source = hf(p + conv[rest])
            return None if source is None else _Transposed(source)
        which, kind = rest.split(".")
        offset = "qkv".index(which) * h
        source = hf(p + f"attn.c_attn.{kind}")
        if source is None:
            return None
        if kind == "bias":
            return _Narrowed(source, 0, offset, h)
        return _Transposed(_Narrowed(source, 1, offset, h))
    return get


def canonical_source(shape: ModelShape, files: Files) -> Callable[[str], Sliceable | None]:
    """`get_full` for `workers.checkpoint.full_state.load_full`: canonical name -> lazy HF
    tensor."""
    if family(shape) == "gpt2":
        return _gpt2_source(shape, files)
    names = _llama_names(shape)
    return lambda name: files(names[name]) if name in names else None


def load_hf(model: nn.Module, shape: ModelShape, path: str,
            groups: RankGroups | None = None) -> list[str]:
    """Load this rank's part of the Hugging Face checkpoint folder `path` into `model`."""
    return load_full(model, canonical_source(shape, open_checkpoint(path)), groups)


def load_init(model: nn.Module, spec: Any, groups: RankGroups | None) -> None:
    """The trainer's one call once the model is built, before `deepspeed.initialize`: the
    weights of `spec.init.from_hf` when it names a checkpoint (else the seeded init stays)."""
    path = spec.init.from_hf
    if path is None:
        return
    try:
        load_hf(model, ModelShape.from_spec(spec.planned_model), path, groups)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"init.from_hf: {path}: {exc}") from exc


# --- out ---------------------------------------------------------------------------------

Lazy = Callable[[], torch.Tensor]
"""A tensor made when called (read from a tag's files, or joined from its shards), so that
the export holds one at a time beside the shard it writes."""


def _const(t: torch.Tensor) -> Lazy:
    return lambda: t


def to_hf_lazy(shape: ModelShape, full: dict[str, Lazy]) -> dict[str, Lazy]:
    """The full tensors (canonical names, lazy) under Hugging Face's names and layouts, each
    made from the canonical ones it is made of when it is called (GPT-2's `c_attn` joins
    three)."""
    def contiguous(*names: str, t: bool = False) -> Lazy:
        def make() -> torch.Tensor:
            parts = [full[n]() for n in names]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            return (out.t() if t else out).contiguous()
        return make

    if family(shape) != "gpt2":
        names = _llama_names(shape)
        return {names[k]: contiguous(k) for k in full if k in names}
    p = "transformer."
    out = {p + "wte.weight": contiguous("embed.tok"), p + "wpe.weight": contiguous("embed.pos"),
           p + "ln_f.weight": contiguous("head.ln.weight"),
           p + "ln_f.bias": contiguous("head.ln.bias")}
    if not shape.tied:
        out["lm_head.weight"] = contiguous("head.weight")
    for i in range(shape.layers):
        c, h = f"layers.{i}.", f"{p}h.{i}."
        for hf, ours in (("ln_1", "ln1"), ("ln_2", "ln2")):
            out[f"{h}{hf}.weight"] = contiguous(f"{c}{ours}.weight")
            out[f"{h}{hf}.bias"] = contiguous(f"{c}{ours}.bias")
        out[h + "attn.c_attn.weight"] = contiguous(
            c + "q.weight", c + "k.weight", c + "v.weight", t=True)
        out[h + "attn.c_attn.bias"] = contiguous(c + "q.bias", c + "k.bias", c + "v.bias")
        out[h + "attn.c_proj.weight"] = contiguous(c + "o.weight", t=True)
        out[h + "attn.c_proj.bias"] = contiguous(c + "o_bias")
        out[h + "mlp.c_fc.weight"] = contiguous(c + "up.weight", t=True)
        out[h + "mlp.c_fc.bias"] = contiguous(c + "up.bias")
        out[h + "mlp.c_proj.weight"] = contiguous(c + "down.weight", t=True)
        out[h + "mlp.c_proj.bias"] = contiguous(c + "down_bias")
    return out


def hf_config(shape: ModelShape, dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` from which `transformers` builds the model of `shape` (with a sliding
    window: Mistral's, or Qwen's `use_sliding_window` from `max_window_layers` on)."""
    kind = family(shape)
    if kind == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_layer": shape.layers, "n_embd": shape.hidden, "n_head": shape.heads,
                "n_inner": shape.ffn_hidden, "vocab_size": shape.vocab,
                "n_positions": shape.seq_len,
                "activation_function": "gelu_new" if shape.gelu_tanh else "gelu",
                "layer_norm_epsilon": shape.norm_eps or 1e-5,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "tie_word_embeddings": shape.tied, "dtype": dtype}
    eps = shape.norm_eps if shape.norm_eps is not None else torch.finfo(torch.float32).eps
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope is not None:
        keys = {"linear": ("rope_type", "factor"),
                "llama3": ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"),
                "yarn": ("rope_type", "factor", "original_max_position_embeddings",
                         "beta_fast", "beta_slow", "attention_factor", "truncate")}
        given = dataclasses.asdict(shape.rope)
        rope = {**{k: given[k] for k in keys[shape.rope.rope_type] if given[k] is not None},
                "rope_theta": shape.rope_theta}
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM"}.get(kind, "LlamaForCausalLM")
    window: dict[str, Any] = {"use_sliding_window": False}
    if shape.sliding_window is not None:  # Mistral: every layer; Qwen: from a layer on
        window = {"sliding_window": shape.sliding_window}
        if kind != "mistral":
            window.update(use_sliding_window=True,
                          max_window_layers=shape.full_attention_layers)
    return {"architectures": [arch],
            "model_type": kind, "num_hidden_layers": shape.layers,
            "hidden_size": shape.hidden, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "intermediate_size": shape.ffn_hidden, "vocab_size": shape.vocab,
            "max_position_embeddings": shape.seq_len, "hidden_act": "silu",
            "rms_norm_eps": eps, "tie_word_embeddings": shape.tied,
            "rope_theta": shape.rope_theta, "rope_parameters": rope,
            "attention_bias": shape.attention_bias, "mlp_bias": shape.mlp_bias,
            "attention_dropout": 0.0, **window, "dtype": dtype}


def save_hf(shape: ModelShape, full: dict[str, torch.Tensor], out: str,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """`write_hf` of tensors already made."""
    return write_hf(shape, {k: _const(v) for k, v in full.items()}, out, max_shard_bytes)


def write_hf(shape: ModelShape, full: dict[str, Lazy], out: str,
             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write the folder `out` as `transformers`' `save_pretrained` does: `config.json` and
    the tensors `full` (canonical names, lazy) under Hugging Face's names, in one
    `model.safetensors` when they fit in `max_shard_bytes`, else in shards
    `model-0000k-of-0000n.safetensors` of at most that many bytes each (a tensor larger has
    one of its own) named by `model.safetensors.index.json` (`weight_map`,
    `metadata.total_size`). Tensor by tensor: a shard is written once the next tensor would
    not fit in it, so that one shard and one tensor are held at most (its number in the
    names is known only at the end: each is written as `.shard-<k>` and renamed). The files
    written."""
    tensors = to_hf_lazy(shape, full)
    os.makedirs(out, exist_ok=True)
    meta = {"format": "pt"}
    shards: list[list[str]] = []  # each shard's tensor names, once written
    dtypes: set[str] = set()
    held: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        write_safetensors(held, os.path.join(out, f".shard-{len(shards)}"), meta)
        shards.append(list(held))
        held.clear()

    for name, make in tensors.items():
        t = make()
        n = t.numel() * t.element_size()
        if held and size + n > max_shard_bytes:
            flush()
            size = 0
        held[name], size, total = t, size + n, total + n
        dtypes.add(str(t.dtype).removeprefix("torch."))
        del t
    flush()
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(shape, dtypes.pop() if len(dtypes) == 1 else "float32"), f,
                  indent=2)
    written = ["config.json"]
    if len(shards) == 1:
        os.replace(os.path.join(out, ".shard-0"), os.path.join(out, SINGLE))
        return [*written, SINGLE]
    weight_map = {}
    width = max(5, int(math.log10(len(shards))) + 1)
    for i, names in enumerate(shards):
        name = f"model-{i + 1:0{width}d}-of-{len(shards):0{width}d}.safetensors"
        os.replace(os.path.join(out, f".shard-{i}"), os.path.join(out, name))
        weight_map.update(dict.fromkeys(names, name))
        written.append(name)
    with open(os.path.join(out, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return [*written, INDEX]
