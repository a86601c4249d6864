"""The job spec: what a user asks Trident to train, and how.

Accepted as JSON over REST and as YAML by the CLI. Field names are the public contract:
add fields freely, never rename. Every check that needs more than one field explains itself
with the arithmetic, and names the field, so the API can turn it into a 422.

One module because the spec is one pydantic model tree and one public contract: `JobSpec`'s
checks across fields and `layout_errors` read the model, train, parallel and resources parts
together, and the parts are read as one document (the API's schema of a submission, the
stored spec). Its vocabularies of a field or two live beside the model that uses them; the
parallel layout's (`ParallelDims`, `Partition`) and the limits of outside input
(`service.contract.spec_limits`) have modules of their own, used beyond the spec.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    Strict,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from service.contract import ds_config
from service.contract.command import ProgressSpec
from service.contract.hardware import PROFILES
from service.contract.parallel import ParallelDims, Partition, layer_split_errors
from service.contract.presets import PRESETS
from service.contract.spec_limits import OsPath, RayQuantity, env_value

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
MAX_COMMAND_ARGS = 256
"""Most arguments of a `command`."""
COMMAND_ARG_MAX_CHARS = 4096
"""Longest argument of a `command`."""
_ENV: dict[str, Any] = {"maxProperties": 256, "propertyNames": {"pattern": _ENV_KEY.pattern}}
MAX_SECRETS = 64
"""Most secrets one job may carry."""
SECRET_MAX_CHARS = 16384
"""Longest secret value (a token, a key; printable text, as an environment value)."""
_URI = re.compile(r"^https?://[^\s/?#@]+(?::\d+)?(?:/[^\s?#]*)?$")
"""http(s), a host (no user:password@), an optional port and path; no query or fragment."""
EXPERIMENT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._/-]{0,249}$"
_SECRETS: dict[str, Any] = {"maxProperties": MAX_SECRETS, "writeOnly": True,
                            "propertyNames": {"pattern": _ENV_KEY.pattern, "maxLength": 128}}

_DS: dict[str, Any] = {"maxProperties": ds_config.MAX_KEYS,
                       "propertyNames": {"maxLength": ds_config.MAX_NAME}}
MAX_WORLD = 65536
MAX_RANKS_PER_NODE = 64
MAX_MICRO_BATCH = 65536
Zero = Literal[0, 1, 2, 3]
Offload = Literal["none", "optimizer", "optimizer+params"]
Stack = Literal["trident", "megatron-lm", "megatron-deepspeed", "deepspeed", "fsdp"]
"""`train.stack`: the training software whose speed and memory the planner models
(`service.planner.software_stacks` holds each stack's constants and their sources); only `trident`
runs on Trident's own workers, the others are for planning runs made elsewhere."""
GPU_DEFAULT = "a100-80gb"
"""Profile assumed for GPU jobs that name no cluster."""


class SpecError(ValueError):
    """A spec that is well-formed field by field but inconsistent as a whole."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class _Strict(BaseModel):
    # strict: a number is a JSON number (a bool or a string is refused; an int is a valid
    # float), a bool is true or false.
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


_INT: TypeAdapter[int] = TypeAdapter(Annotated[int, Strict()])


def _as_int(value: Any) -> int | None:
    """`value` read as pydantic reads an int field, or None when it is not one."""
    try:
        return _INT.validate_python(value)
    except ValidationError:
        return None


_DIMENSIONS = ("layers", "hidden", "heads", "kv_heads", "vocab", "seq_len", "ffn_hidden",
               "activation", "head_dim", "rope_theta", "rope_scaling")
"""The keys a preset supplies to a spec (`service.contract.presets` holds more, for the planner)."""


class RopeScalingSpec(_Strict):
    """A rotary scaling, under `transformers`' names (`rope_parameters` / `rope_scaling` of a
    `config.json`): `linear` (every frequency / `factor`), `llama3` (Llama 3.1+: the low
    frequencies / `factor`, the high ones kept, blended between `low_freq_factor` and
    `high_freq_factor` of `original_max_position_embeddings`) or `yarn` (YaRN: a ramp between
    the `beta_fast` and `beta_slow` rotations, cos and sin times `attention_factor`, default
    0.1 ln(factor) + 1)."""

    rope_type: Literal["linear", "llama3", "yarn"]
    """The scaling's kind (`transformers`' `rope_type`)."""
    factor: Annotated[float, Field(gt=0, le=1e6)]
    """How much longer a context the positions stretch to (Llama 3.1: 8)."""
    low_freq_factor: Annotated[float, Field(gt=0, le=1e6)] = 1.0
    """llama3: wavelengths above original / low_freq_factor are divided by `factor`."""
    high_freq_factor: Annotated[float, Field(gt=0, le=1e6)] = 4.0
    """llama3: wavelengths below original / high_freq_factor are kept."""
    original_max_position_embeddings: Annotated[int, Field(ge=1, le=1 << 24)] | None = None
    """The pretraining context (`llama3` and `yarn` need it)."""
    beta_fast: Annotated[float, Field(gt=0, le=1e6)] = 32.0
    """yarn: rotations over the original context below which a frequency is interpolated."""
    beta_slow: Annotated[float, Field(gt=0, le=1e6)] = 1.0
    """yarn: rotations above which a frequency is kept."""
    attention_factor: Annotated[float, Field(gt=0, le=1e6)] | None = None
    """yarn: what cos and sin are multiplied by; default 0.1 ln(factor) + 1."""
    truncate: bool = True
    """yarn: round the ramp's ends to whole dimensions (transformers' default)."""

    @model_validator(mode="after")
    def _complete(self) -> RopeScalingSpec:
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            error = ValueError(f"{self.rope_type} RoPE scaling needs the pretraining context")
            raise ValidationError.from_exception_data(type(self).__name__, [{
                "type": "value_error", "loc": ("original_max_position_embeddings",),
                "input": None, "ctx": {"error": error}}])
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            error = ValueError(f"high_freq_factor({self.high_freq_factor}) must be above"
                               f" low_freq_factor({self.low_freq_factor})")
            raise ValidationError.from_exception_data(type(self).__name__, [{
                "type": "value_error", "loc": ("high_freq_factor",),
                "input": self.high_freq_factor, "ctx": {"error": error}}])
        return self


class ModelSpec(_Strict):
    """A decoder-only transformer: a preset, explicit dimensions, or a preset with overrides.

    The preset is merged before the fields are validated, so a validated spec holds every
    dimension as a plain number, and its dump validates back to the same spec.
    """

    preset: str | None = None
    """Name of a preset shape (see `service.contract.presets`); explicit fields below override
    it."""
    layers: Annotated[int, Field(ge=1, le=1024)]
    """Number of transformer blocks."""
    hidden: Annotated[int, Field(ge=8, le=131072)]
    """Hidden size h."""
    heads: Annotated[int, Field(ge=1, le=1024)]
    """Attention heads a (query heads)."""
    kv_heads: Annotated[int, Field(ge=1, le=1024)]
    """Key/value heads for grouped-query attention; defaults to `heads` (multi-head)."""
    vocab: Annotated[int, Field(ge=2, le=1_048_576)]
    """Vocabulary size V."""
    seq_len: Annotated[int, Field(ge=2, le=1_048_576)]
    """Sequence length s in tokens."""
    ffn_hidden: Annotated[int, Field(ge=1, le=1_048_576)]
    """MLP inner size; defaults to 4 * hidden."""
    activation: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu"
    """MLP type: `gelu` (two matrices, GPT, exact erf GELU), `gelu_tanh` (the same with GELU's
    tanh approximation: GPT-2's `gelu_new`) or `swiglu` (three matrices, Llama)."""
    tied: bool | None = None
    """The LM head shares the token embedding; default: the preset's, else tied for `gelu`
    (GPT) and untied for `swiglu` (Llama)."""
    rope_theta: Annotated[float, Field(gt=0, le=1e9)] = 10000.0
    """The base of rotary positions (Llama 2: 10000, Llama 3: 500000)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2), for a family without
    linear biases (`swiglu`); the GPT family's biases are on every linear layer already."""
    norm_eps: Annotated[float, Field(gt=0, le=1.0)] | None = None
    """The norms' epsilon (Llama: `rms_norm_eps`, GPT-2: `layer_norm_epsilon`); default:
    torch's (LayerNorm 1e-5, RMSNorm the dtype's machine epsilon)."""
    sliding_window: Annotated[int, Field(ge=1, le=1_048_576)] | None = None
    """Sliding-window attention (Mistral's `sliding_window`, Qwen2's with
    `use_sliding_window`): a token attends to itself and the `sliding_window - 1` tokens before
    it; None (or a window of seq_len or more): full causal attention."""
    full_attention_layers: Annotated[int, Field(ge=0, le=1024)] = 0
    """With `sliding_window`: the first this many blocks attend fully, the others slide
    (Qwen2's `max_window_layers`; Mistral: 0, every block slides)."""
    head_dim: Annotated[int, Field(ge=2, le=65536)] | None = None
    """Each attention head's size; default hidden / heads (Qwen3 and Gemma set their own:
    q is heads x head_dim wide, k and v kv_heads x head_dim)."""
    qk_norm: bool = False
    """An RMSNorm over each head of q and k before the rotary positions (Qwen3)."""
    attention_bias: bool = False
    """Biases on q, k, v and the attention output (Llama's `attention_bias`)."""
    mlp_bias: bool = False
    """Biases on every MLP linear (Llama's `mlp_bias`)."""
    rope_scaling: RopeScalingSpec | None = None
    """The rotary frequencies' scaling (Llama 3.1+: `llama3`; `linear`, `yarn`); default
    none."""
    hf_config: OsPath | None = None
    """A Hugging Face `config.json` on the server (inside its checkpoint roots) that gives
    every dimension and trait (`service.contract.hf_config`: Llama, Mistral, Qwen2, Qwen3,
    GPT-2); the
    fields given beside it (`seq_len`, ...) override the config's. Read once at submission: the
    stored spec holds the dimensions read."""

    @model_validator(mode="before")
    @classmethod
    def _merge_preset(cls, data: Any) -> Any:
        preset = data.get("preset") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(preset, str | None):
            return data  # a validated ModelSpec, or a wrong type for pydantic to name
        from service.contract.hf_config import read_fields, wanted
        if wanted(data) is not None:
            data = {**read_fields(data["hf_config"], data.get("seq_len")), **data}
        if isinstance(preset, str) and preset not in PRESETS:
            # Refused here, at the field, so that the missing dimensions are not reported too.
            error = ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
            raise ValidationError.from_exception_data(cls.__name__, [{
                "type": "value_error", "loc": ("preset",), "input": preset,
                "ctx": {"error": error}}])
        base = PRESETS[preset] if preset is not None else {}
        # A dimension given as null takes the preset's value, as an absent one does.
        merged = {k: v for k, v in data.items() if not (k in _DIMENSIONS and v is None)}
        for key in _DIMENSIONS:
            if key not in merged and key in base:
                merged[key] = base[key]
        missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq_len")
                   if k not in merged]
        if missing:
            raise ValueError(f"{', '.join(missing)} required when no preset is given")
        # Defaults that follow other fields; when those are not numbers, their own errors say so.
        heads, hidden = _as_int(merged.get("heads")), _as_int(merged.get("hidden"))
        if "kv_heads" not in merged and heads is not None:
            merged["kv_heads"] = heads
        if "ffn_hidden" not in merged and hidden is not None:
            merged["ffn_hidden"] = 4 * hidden
        return merged

    @model_validator(mode="after")
    def _divisible(self) -> ModelSpec:
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden({self.hidden}) is not divisible by heads({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads({self.heads}) is not divisible by kv_heads({self.kv_heads})")
        if self.full_attention_layers and self.sliding_window is None:
            raise ValueError(f"full_attention_layers({self.full_attention_layers}) needs a"
                             " sliding_window (the blocks after them slide)")
        if self.full_attention_layers > self.layers:
            raise ValueError(f"full_attention_layers({self.full_attention_layers}) >"
                             f" layers({self.layers})")
        return self


class BatchRamp(_Strict):
    """A global batch that grows from `start` to `train.global_batch` by `increment`, over the
    first `samples` samples (Megatron's `--rampup-batch-size START INCREMENT SAMPLES`,
    `megatron.core.num_microbatches_calculator`): the batch of a step is a function of the
    samples consumed before it (`TrainSpec.batch_at`), so a resumed run ramps on where the
    checkpoint left it."""

    start: Annotated[int, Field(ge=1, le=1_048_576)]
    """The first steps' global batch: below `train.global_batch`, a multiple of micro_batch *
    dp."""
    increment: Annotated[int, Field(ge=1, le=1_048_576)]
    """What the batch grows by each time; divides `global_batch - start`, a multiple of
    micro_batch * dp."""
    samples: Annotated[int, Field(ge=1, le=1 << 40)]
    """Samples the ramp takes: after them every step trains on `train.global_batch`."""


class GuardSpec(_Strict):
    """The training guards (`docs/guards.md`, `workers.trainer.guard`): a step whose loss or
    gradient norm is not finite is skipped (no optimizer update on any rank) and counted; a
    loss spike does what `on_spike` says; a run of skipped steps rolls back."""

    max_skips: Annotated[int, Field(ge=0, le=1000)] = 3
    """Skipped steps in a row tolerated: one more rolls back to the newest checkpoint and
    never reads those steps' samples again (the job stops, with the reason, when there is no
    checkpoint)."""
    spike_factor: Annotated[float, Field(gt=1, le=1e6)] = 5.0
    """A loss above this times the median of the last `window` losses is a spike."""
    window: Annotated[int, Field(ge=1, le=100_000)] = 100
    """Steps whose losses the running median is taken over (spikes are judged once it holds
    `min(window, 5)` losses)."""
    on_spike: Literal["skip", "rollback", "stop"] = "skip"
    """What a spike does: `skip` its update (counted as a skipped step), `rollback` to the
    newest checkpoint at once, or `stop` the job with the reason. Under a pipeline (pp > 1)
    the loss comes after its update: a spike under `skip` is reported and the update kept."""


class TrainSpec(_Strict):
    """The optimisation run."""

    steps: Annotated[int, Field(ge=1, le=10_000_000)] = 100
    """Optimizer steps to run: iterations, each reading one global batch. A step the guard
    skips (`guard`) and the steps a rollback undoes still count, so a job of `steps` steps
    makes `steps` minus those optimizer updates (Megatron's rule: the iteration is
    consumed, its update skipped)."""
    global_batch: Annotated[int, Field(ge=1, le=1_048_576)] = 8
    """Sequences per optimizer step, across all data-parallel replicas (after the ramp, with
    `batch_ramp`)."""
    batch_ramp: BatchRamp | None = None
    """Ramp the global batch up to `global_batch` (None: every step trains on `global_batch`).
    `steps` still counts optimizer steps, whatever their batch."""
    micro_batch: Annotated[int, Field(ge=1, le=MAX_MICRO_BATCH)] = 1
    """Sequences per forward/backward pass on one rank."""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Arithmetic precision of weights and activations (optimizer states stay fp32)."""
    lr: Annotated[float, Field(gt=0, le=10)] = 3e-4
    """Peak learning rate (AdamW): reached at the end of the warmup, then decayed."""
    min_lr: Annotated[float, Field(ge=0, le=10)] = 0.0
    """The rate the decay ends at (at most `lr`); kept after `decay_steps`."""
    warmup_steps: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    """Steps of linear warmup: step n (1-based) of the warmup runs at lr * n / warmup_steps."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """How the rate goes from `lr` to `min_lr` over `decay_steps` after the warmup
    (`constant`: stays at `lr`)."""
    decay_steps: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """Steps the decay takes after the warmup; default: the rest of the run (steps -
    warmup_steps, at least 1)."""
    weight_decay: Annotated[float, Field(ge=0, le=10)] = 0.1
    """AdamW's decoupled weight decay, on the weight matrices only (see `weight_decay_all`)."""
    weight_decay_all: bool = False
    """Also decay norms, biases and embeddings (which are not decayed by default)."""
    betas: Annotated[list[Annotated[float, Field(ge=0, lt=1)]],
                     Field(min_length=2, max_length=2)] = [0.9, 0.95]
    """AdamW's [beta1, beta2], each in [0, 1)."""
    eps: Annotated[float, Field(gt=0, le=1)] = 1e-8
    """AdamW's epsilon."""
    grad_clip: Annotated[float, Field(ge=0, le=1e6)] = 1.0
    """Clip the gradient to this global norm (over every TP, PP and DP rank); 0: no clipping.
    The norm before clipping is reported with each step (`grad_norm`)."""
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 1234
    """Seed of initialisation, of the synthetic data and of the corpora's sample order."""
    stack: Stack = "trident"
    """Training software the planner models (speed, memory); Trident runs only `trident`."""
    guard: GuardSpec = GuardSpec()
    """The NaN and loss-spike guards (on by default; `docs/guards.md`)."""
    compile: bool = False
    """Compile each transformer block with `torch.compile` (inductor; on CPU its C++ backend,
    which needs a C++ compiler). The first step then also compiles (reported as its
    `compile_s`). Refused with ZeRO-3 (its parameter hooks gather and release the weights
    inside the block), with activation recompute (the checkpoint reruns the block outside the
    compiled graph), with interleaved stages (untested) and on custom entrypoints."""

    @model_validator(mode="after")
    def _schedule(self) -> TrainSpec:
        if self.min_lr > self.lr:  # refused at the field, as an unknown preset is
            error = ValueError(f"min_lr({self.min_lr}) is above lr({self.lr}), the peak rate"
                               " it decays from")
            raise ValidationError.from_exception_data(type(self).__name__, [{
                "type": "value_error", "loc": ("min_lr",), "input": self.min_lr,
                "ctx": {"error": error}}])
        ramp = self.batch_ramp
        if ramp is not None:
            if ramp.start >= self.global_batch:
                _refuse(("batch_ramp", "start"), ramp.start,
                        f"start({ramp.start}) is not below global_batch({self.global_batch}),"
                        " the batch the ramp grows to")
            if (self.global_batch - ramp.start) % ramp.increment:
                _refuse(("batch_ramp", "increment"), ramp.increment,
                        f"increment({ramp.increment}) does not divide global_batch"
                        f"({self.global_batch}) - start({ramp.start}) ="
                        f" {self.global_batch - ramp.start}")
        return self

    def batch_at(self, consumed: int) -> int:
        """The global batch of the step that follows `consumed` samples: Megatron's ramp
        (`RampupBatchsizeNumMicroBatchesCalculator.update`): `global_batch` once more than
        `samples` were consumed, else `start` plus an `increment` for every
        `samples / increments` samples consumed."""
        ramp = self.batch_ramp
        if ramp is None or consumed > ramp.samples:
            return self.global_batch
        per_increment = ramp.samples / ((self.global_batch - ramp.start) // ramp.increment)
        return ramp.start + int(consumed / per_increment) * ramp.increment

    def decay_span(self) -> int:
        """Steps of the decay: `decay_steps`, or the rest of the run after the warmup."""
        return self.decay_steps or max(1, self.steps - self.warmup_steps)

    def lr_at(self, step: int) -> float:
        """The learning rate of 1-based optimizer step `step` (Megatron's schedule: linear
        warmup, then cosine, linear or constant decay to `min_lr`, then `min_lr`)."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.decay == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / self.decay_span())
        if self.decay == "linear":
            return self.lr - (self.lr - self.min_lr) * progress
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _refuse(loc: tuple[str, ...], value: object, why: str) -> None:
    """A model validator's refusal at the field `loc` (inside its model), as a field's own."""
    raise ValidationError.from_exception_data("TrainSpec", [{
        "type": "value_error", "loc": loc, "input": value, "ctx": {"error": ValueError(why)}}])


class ParallelSpec(_Strict):
    """An explicit layout: tp * pp * dp ranks, ZeRO over the dp group."""

    tp: Annotated[int, Field(ge=1, le=1024)] = 1
    """Tensor-parallel degree (Megatron column/row split); best kept within one node."""
    pp: Annotated[int, Field(ge=1, le=1024)] = 1
    """Pipeline-parallel degree: number of stages."""
    dp: Annotated[int, Field(ge=1, le=MAX_WORLD)] = 1
    """Data-parallel degree: model replicas, the group ZeRO shards over."""
    zero: Zero = 0
    """DeepSpeed ZeRO stage over the dp group."""
    offload: Offload = "none"
    """CPU offload: optimizer states (ZeRO >= 1), or also parameters (ZeRO-3)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: none, selective (attention core), or full (each block)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism in LayerNorm/dropout regions (needs tp > 1)."""
    virtual_stages: Annotated[int, Field(ge=1, le=64)] = 1
    """Interleaved model chunks per pipeline rank (needs pp > 1)."""
    partition: Partition = "uniform"
    """How stages split the layers: evenly (`uniform`) or by `parameters` (as DeepSpeed)."""

    @field_validator("zero", mode="before")
    @classmethod
    def _zero_is_an_int(cls, v: Any) -> Any:  # a Literal alone takes true and 1.0 for 1
        if type(v) is not int:
            raise ValueError(f"zero is an integer 0, 1, 2 or 3, got {type(v).__name__}")
        return v

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(tp=self.tp, pp=self.pp, dp=self.dp)


class ResourcesSpec(_Strict):
    """What each rank claims from the cluster."""

    gpus_per_worker: Annotated[int, Field(ge=0, le=16)] = 0
    """GPUs per rank: 1 on GPU clusters, 0 to run on CPU with gloo."""
    cpus_per_worker: Annotated[RayQuantity, Field(gt=0, le=1024)] = 1.0
    """CPUs per rank; a multiple of Ray's unit (0.0001), so that ranks may share a core."""
    workers: Annotated[int, Field(ge=1, le=MAX_WORLD)] | None = None
    """Ranks of a `command` job without `model` (required there): it is placed from
    `resources` alone, `workers` data-parallel ranks, and not planned (`docs/command.md`).
    Beside a `model`, it may only repeat the layout's tp * pp * dp."""


class ClusterSpec(_Strict):
    """Target hardware for planning; a live cluster describes itself."""

    gpu: str = "cpu"
    """Hardware profile name, e.g. a100-80gb, h100-80gb, h200, v100-32gb, cpu."""
    nodes: Annotated[int, Field(ge=1, le=4096)] = 1
    """Number of nodes."""
    gpus_per_node: Annotated[int, Field(ge=1, le=MAX_RANKS_PER_NODE)] = 8
    """Devices (or CPU ranks) per node."""

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        if v not in PROFILES:
            raise ValueError(f"unknown hardware profile {v!r}; known: {sorted(PROFILES)}")
        return v


class ResumeFrom(_Strict):
    """Another job's checkpoint tag a job starts from (`trident resubmit JOB
    --from-checkpoint`): set by the resubmission route only, once it checked that the caller
    may read that job and that the tag is there."""

    job: Annotated[int, Field(ge=1, le=2**31 - 1)]
    """The job whose checkpoint folder holds the tag."""
    step: Annotated[int, Field(ge=1, le=10_000_000)]
    """The tag's step: the new job's first attempt resumes from it."""


class InitSpec(_Strict):
    """Where the weights start (default: the seeded per-weight init, `workers.modeling.model`)."""

    from_hf: OsPath | None = None
    """A Hugging Face checkpoint folder on the server (inside its checkpoint roots): its
    `model.safetensors`, or the shards its `model.safetensors.index.json` names. Each rank
    reads only its slices (`workers.checkpoint.hf_weights`); the tensors must have the model's
    shapes."""


class CheckpointSpec(_Strict):
    """Periodic DeepSpeed checkpoints, used to resume a restarted attempt."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True,
                              validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    every_steps: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    """Save every this many steps; 0 saves none."""
    dir: OsPath | None = None
    """The job's own folder inside the checkpoint roots (default: `checkpoints/job-<id>` in the
    data directory); not a root, the data directory, nor another job's. 4095 bytes at most."""
    keep_last: Annotated[int, Field(ge=1, le=10_000)] | None = None
    """Keep the newest this many complete tags (None: keep every tag). Older ones are
    deleted by rank 0 only once a newer tag is complete (`workers.checkpoint.saving.prune`)."""
    keep_every: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """With `keep_last`: also keep every tag whose step is a multiple of this (a multiple of
    `every_steps`, so that such tags are saved at all)."""
    background: bool = Field(default=True, alias="async")
    """`async` (the default): the loop waits only while each rank copies its state to host
    memory; a thread per rank writes the files, and the tag is marked complete at a later step
    boundary once every rank's are durable (`workers.checkpoint.background`), so that a
    failure before then resumes from the tag before (docs/checkpoints.md). False: a save
    blocks the loop until its tag is complete."""
    resume_from: ResumeFrom | None = None
    """The job starts from this tag of another job (read there, never written): its first
    attempt finds it in its own folder (`service.files.checkpoint_dirs.seed`). Set by
    `POST /jobs/{id}/resubmit` with `from_checkpoint` only; a submission naming it is a
    422."""

    @model_validator(mode="after")
    def _retention(self) -> CheckpointSpec:
        if self.keep_every is not None:
            if self.keep_last is None:
                raise ValueError("keep_every: only with keep_last (without it every tag is"
                                 " kept)")
            if not self.every_steps or self.keep_every % self.every_steps:
                raise ValueError(f"keep_every: {self.keep_every} is not a multiple of"
                                 f" every_steps ({self.every_steps}): no tag would be saved"
                                 " at its steps")
        return self


class ElasticSpec(_Strict):
    """Elastic re-plan (`docs/checkpoints.md`): when the job loses ranks and the cluster does
    not give them back within `wait_s`, it resumes from its newest checkpoint on the layout
    the planner finds best for what can be placed then (the same model and global batch; a
    DP-degree change the checkpoint conversion covers), and with `scale_up` moves back when
    the room returns."""

    min_ranks: Annotated[int, Field(ge=1, le=MAX_WORLD)] = 1
    """The fewest ranks it may run on (at most its own world size)."""
    wait_s: Annotated[float, Field(ge=0, le=86400)] = 300.0
    """How long it waits, once its ranks are lost, for the cluster to give them back before
    it is re-planned smaller."""
    scale_up: bool = False
    """Once re-planned smaller: when the room of a larger layout (up to the submitted one)
    is free again, save a checkpoint now and resume on it."""


MIN_PROBE_EVERY_S = 5.0
"""The shortest interval between a job's periodic bandwidth probes (`monitor.probe_every_s`)."""


class MonitorSpec(_Strict):
    """The health monitor: bandwidth probe, communication accounting, hangs, stragglers."""

    probe: bool = True
    """Probe every TP group, DP group and PP pair's bandwidth before training."""
    probe_max_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 64 << 20
    """Largest probe message: the job's probe runs the largest of `trident probe`'s sizes (1
    KiB in powers of 4) up to this, and every other one below it."""
    hang_timeout_s: Annotated[float, Field(ge=1, le=86400)] = 300.0
    """A job with no rank making progress for this long is hung: diagnosed and stopped."""
    comm_sample_every: Annotated[int, Field(ge=1, le=100000)] = 10
    """On GPUs, time collectives with CUDA events every this many steps."""
    memory_every: Annotated[int, Field(ge=1, le=100000)] = 50
    """Measure the rank's model states and saved activations every this many steps (a hook
    on every activation and a walk of the optimizer state: they cost a step time), and on the
    steps the monitor must watch: an attempt's first and last, every step once the memory
    nears the device's capacity (`workers.monitor.memory`). The process peak is read every
    step; the other fields of an unmeasured step are not measured (null)."""
    straggler_threshold: Annotated[float, Field(gt=1, le=100)] = 1.25
    """A rank slower than this times its pipeline-stage peers' compute time is a straggler."""
    straggler_min_steps: Annotated[int, Field(ge=1, le=10000)] = 5
    """... for this many consecutive steps."""
    slow_group_threshold: Annotated[float, Field(gt=0, le=1)] = 0.5
    """A probed group below this fraction of the profile's expected bandwidth is flagged; a
    link between hosts below this fraction of the cluster's fastest is slow
    (`service.monitor.links`)."""
    probe_every_s: Annotated[float, Field(ge=0, le=86400)] = 600.0
    """Probe again every this many seconds of training, at a step boundary, to find a link
    that became slow (the built-in trainer; 0: only before training). Each probe costs the
    job about a second (gloo, the default sizes); a slow link is named within two intervals
    (judged where `probe_max_bytes` is 1 MiB or more: `service.monitor.links`)."""

    @field_validator("probe_every_s")
    @classmethod
    def _probe_interval(cls, v: float) -> float:
        if 0 < v < MIN_PROBE_EVERY_S:
            raise ValueError(f"{v:g} s: probe at most every {MIN_PROBE_EVERY_S:g} s, or 0 for"
                             " only before training")
        return v


class FaultSpec(_Strict):
    """A fault injected into one rank, for tests; refused unless the server allows faults."""

    kind: Literal["hang", "slow", "fail", "kill", "nan", "spike"]
    """hang: sleep `seconds` once, before the step's first collective (mid-step, after the
    forward pass has started); slow: the same on every step from `step` on; fail: raise;
    kill: end the rank's process; nan: the rank's loss is NaN at `step`; spike: its loss is
    multiplied by `factor` at `step` (the built-in trainer; nan and spike fire the first time
    the attempt reaches the step, as bad data would: a rollback reads other samples there)."""
    rank: Annotated[int, Field(ge=0, le=65535)]
    """The rank to hit."""
    step: Annotated[int, Field(ge=1, le=10_000_000)]
    """The step at whose start the fault fires."""
    seconds: Annotated[float, Field(ge=0, le=86400)] = 0.0
    """Sleep length for hang and slow."""
    factor: Annotated[float, Field(gt=0, le=1e9)] = 100.0
    """What a spike multiplies the loss by."""
    attempt: Annotated[int, Field(ge=1, le=1000)] = 1
    """The attempt it fires in (so that a restarted attempt can succeed)."""


MAX_CORPORA = 64
"""Most corpora in `data.train` (and in `data.valid`)."""
MAX_DATA_SAMPLES = 1 << 31
"""Most samples a `tokens` job's sample order may hold: train.steps * train.global_batch (its
cached index costs about 30 bytes a sample, built once by one process; `workers.trainer.data`)."""


class CorpusRef(_Strict):
    """One corpus of a blend: a Megatron indexed dataset (`PATH.bin` + `PATH.idx`)."""

    path: OsPath
    """The corpus's prefix, absolute, inside the server's data roots (`TRIDENT_DATA_ROOTS`):
    `/corpora/web/web_text_document` names `web_text_document.bin` and `.idx` there."""
    weight: Annotated[float, Field(gt=0, le=1e6)] = 1.0
    """Its share of the blend, relative to the others' (normalised to sum to 1)."""
    fingerprint: Annotated[str, Field(max_length=256)] | None = None
    """Set by the server at submission (size, modification time, inode and status-change
    time of both files, `service.files.data_check`); a submitted value is replaced. A rank that
    finds the corpus changed since fails the job, naming the file, without a retry."""

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"{v[:200]!r} is not an absolute path")
        return v


class DataSpec(_Strict):
    """What the job trains on (`docs/data.md`): synthetic sequences, or tokenized corpora."""

    kind: Literal["synthetic", "tokens", "chat"] = "synthetic"
    """`synthetic`: noisy arithmetic sequences drawn from the seed (`workers.trainer.data`), no
    files;
    `tokens`: the corpora of `train`, prepared by `trident data prepare` (or Megatron-LM's
    `preprocess_data.py`);
    `chat`: corpora prepared by `trident data prepare --chat`, each with its loss mask
    `PREFIX_loss_mask` beside it: only the tokens it marks (the assistant's) train, the loss
    averaged over the tokens that train in the global batch; `document_mask` defaults to on."""
    train: Annotated[list[CorpusRef], Field(max_length=MAX_CORPORA)] = Field(
        default_factory=list)
    """The training corpora and their weights (kind `tokens`): each sample is drawn from the
    corpus furthest below its share (Megatron's blending rule)."""
    valid: Annotated[list[CorpusRef], Field(max_length=MAX_CORPORA)] = Field(
        default_factory=list)
    """Validation corpora (kind `tokens`); or `valid_fraction`, not both."""
    valid_fraction: Annotated[float, Field(ge=0, le=0.5)] = 0.0
    """Hold out this fraction of each training corpus's documents (the last ones) for
    validation instead of naming `valid` corpora; 0: none."""
    eval_every: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    """Evaluate the validation loss every this many steps (and after the last); 0: never."""
    eval_batches: Annotated[int, Field(ge=1, le=10_000)] = 4
    """Global batches per evaluation: the same first `eval_batches * train.global_batch`
    samples of the validation order every time, so evaluations compare."""
    document_mask: bool = False
    """Kind `tokens`: attention never crosses a document boundary inside a packed window,
    and positions restart at 0 in each document (Megatron's `reset_attention_mask` and
    `reset_position_ids`); the documents are the corpus's sequences (`docs/data.md`)."""
    eod_loss_mask: bool = False
    """Kind `tokens`: no loss on the prediction made at each document's last token, its EOD
    (of the next document's first token; Megatron's `eod_mask_loss`)."""

    @model_validator(mode="before")
    @classmethod
    def _chat_documents(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kind") == "chat" and "document_mask" not in data:
            return {**data, "document_mask": True}
        return data

    @property
    def corpora(self) -> bool:
        """Whether the job reads corpora (kinds `tokens` and `chat`)."""
        return self.kind != "synthetic"

    @model_validator(mode="after")
    def _consistent(self) -> DataSpec:
        if self.kind == "synthetic":
            for name in ("train", "valid"):
                if getattr(self, name):
                    raise SpecError(f"data.{name}", "corpora are for kind 'tokens'; kind"
                                    " 'synthetic' draws its data from the seed")
            if self.valid_fraction:
                raise SpecError("data.valid_fraction", "valid_fraction is for kind 'tokens'")
            for name in ("document_mask", "eod_loss_mask"):
                if getattr(self, name):
                    raise SpecError(f"data.{name}", "documents are a corpus's: kind 'tokens';"
                                    " a synthetic sample is one sequence")
            return self
        if not self.train:
            raise SpecError("data.train", f"kind '{self.kind}' needs at least one training"
                            " corpus")
        if self.valid and self.valid_fraction:
            raise SpecError("data.valid_fraction", "give valid corpora or valid_fraction,"
                            " not both")
        if self.eval_every and not self.valid and not self.valid_fraction:
            raise SpecError("data.eval_every", f"eval_every({self.eval_every}) needs"
                            " validation data: valid corpora or a valid_fraction")
        return self


def normal_uri(uri: str) -> str:
    """An MLflow URI as compared with the ones a server allows: without a trailing slash."""
    return uri.rstrip("/")


def check_uri(uri: str) -> str:
    """`uri` normalised, or ValueError saying what an MLflow URI here must look like."""
    if not _URI.match(uri):
        raise ValueError(f"{uri[:200]!r} is not an http(s) URI without credentials, query or"
                         " fragment (http(s)://host[:port][/path])")
    return normal_uri(uri)


class TrackingSpec(_Strict):
    """Where the job's metrics go besides Trident's own store (docs/tracking.md): sent by the
    control plane from the store, never by the ranks (`service.tracking`)."""

    mlflow: Annotated[str, Field(max_length=2048)] | None = None
    """An MLflow tracking server for this job (`http(s)://host[:port][/path]`), one of those
    the server allows (`TRIDENT_MLFLOW_URIS`, checked by `service.submission.confine`); default: the
    server's `TRIDENT_MLFLOW_URI`, if it has one."""
    experiment: Annotated[str, Field(pattern=EXPERIMENT_PATTERN)] | None = None
    """The MLflow experiment the job's run goes into (default: the job's project, or
    `trident`)."""
    enabled: bool = True
    """False: this job goes to no tracker (neither MLflow nor TensorBoard files)."""

    @field_validator("mlflow")
    @classmethod
    def _http_uri(cls, v: str | None) -> str | None:
        return None if v is None else check_uri(v)


class JobSpec(_Strict):
    """A training job: model, run, layout, resources and policies."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
    """Human-readable job name (letters, digits, '.', '_', '-'; at most 128)."""
    model: ModelSpec | None = None
    """The transformer to train, and plan. Required, except for a `command` job, which
    without it is placed from `resources.workers` alone and not planned (no predicted memory
    nor step time)."""
    train: TrainSpec = TrainSpec()
    """The optimisation run."""
    parallel: ParallelSpec | Literal["auto"] = ParallelSpec()
    """An explicit layout, or "auto" to let the planner choose."""
    resources: ResourcesSpec = ResourcesSpec()
    """Per-rank resource claims."""
    cluster: ClusterSpec | None = None
    """Target hardware for planning; when given, tp * pp * dp must use all of it. Default:
    exactly the job's own ranks, on the `cpu` profile (or `gpu_default` with GPUs)."""
    checkpoint: CheckpointSpec = CheckpointSpec()
    """Checkpoint policy."""
    init: InitSpec = InitSpec()
    """Where the weights start: the seeded init, or a Hugging Face checkpoint."""
    data: DataSpec = DataSpec()
    """What the job trains on: synthetic sequences (the default) or tokenized corpora."""
    max_retries: Annotated[int, Field(ge=0, le=100)] = 0
    """Restarts from the last checkpoint allowed after a recoverable failure."""
    env: dict[str, Annotated[str, Field(max_length=4096)]] = Field({}, json_schema_extra=_ENV)
    """Environment variables for every rank (e.g. NCCL_*); no LD_*, PYTHON*, PATH (admins).
    Readable by the job's owner and admins only (others see the names)."""
    secrets: dict[Annotated[str, Field(max_length=128)],
                  Annotated[SecretStr, Field(max_length=SECRET_MAX_CHARS)]] = Field(
        {}, exclude=True, json_schema_extra=_SECRETS)
    """Environment variables for every rank whose values are secret (tracker tokens, keys):
    write-only; no LD_*, PYTHON*, PATH (admins), as in `env`. Stored apart from the spec,
    encrypted (`service.secrets`), never returned by any route, page, event or export
    (their names are), given to the ranks' environment only. A dump of the spec leaves them out
    (`secret_values` reads them)."""
    tracking: TrackingSpec = TrackingSpec()
    """Where the job's metrics go: MLflow, TensorBoard files (`docs/tracking.md`)."""
    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0
    """Higher runs first among queued jobs, and a queued job that cannot be placed preempts
    running jobs of strictly lower priority (`docs/checkpoints.md`). At most the project's
    `max_priority` unless an admin submits."""
    preemptible: bool = True
    """False: never preempted for a job of higher priority (admins only)."""
    elastic: ElasticSpec | None = None
    """Re-plan the layout when ranks are lost (`min_ranks`, `wait_s`, `scale_up`; needs
    `checkpoint.every_steps` and `max_retries` >= 1); None: a job that lost ranks waits QUEUED
    until the cluster can hold its layout again."""
    entrypoint: Annotated[str, Field(max_length=512)] | None = None
    """Custom per-rank training function, "package.module:function"; default: built-in GPT."""
    command: Annotated[list[Annotated[str, Field(min_length=1,
                                                 max_length=COMMAND_ARG_MAX_CHARS)]],
                       Field(min_length=1, max_length=MAX_COMMAND_ARGS)] | None = None
    """Run this program once per rank instead of the built-in trainer or an `entrypoint`:
    its arguments (the first the program, looked up on the workers' PATH), started in
    `workdir` with torchrun's environment (`docs/command.md`). Refused unless the server has
    code roots (`TRIDENT_CODE_ROOTS`), and for members unless it allows their commands
    (`TRIDENT_ALLOW_MEMBER_COMMANDS`)."""
    progress: ProgressSpec | None = None
    """With `command`: which rank's output lines are its steps, by a pattern or a preset
    (`service.contract.command`, `docs/command.md`); None: only the report file's
    (`TRIDENT_REPORT`)."""
    workdir: OsPath | None = None
    """With `command` (and only with it): the folder it starts in, an absolute path inside the
    server's code roots (`TRIDENT_CODE_ROOTS`); no code is uploaded through the API."""
    program: Literal["light"] | None = None
    """`light`: the ranks run the light rank program (`workers.rank.light`), the job's steps
    on the clock with numbers that are not measured and no model, torch nor DeepSpeed (with
    `entrypoint`: that function, given a context without device, groups or data), for the
    tests of the control plane only; refused unless the server sets TRIDENT_LIGHT_RANKS,
    which prod refuses. None: the built-in trainer, or `entrypoint`."""
    monitor: MonitorSpec = MonitorSpec()
    """Health monitor settings."""
    faults: Annotated[list[FaultSpec], Field(max_length=16)] = Field(default_factory=list)
    """Faults to inject (tests only; the server must set TRIDENT_ALLOW_FAULTS)."""
    deepspeed: dict[str, Any] = Field(default_factory=dict, json_schema_extra=_DS)
    """Keys of a DeepSpeed config (`ds_config.json`) that do not decide the layout: bucket
    sizes, `overlap_comm`, `contiguous_gradients`, `communication_data_type`, ... (the allow
    list: `service.contract.ds_config`); a key the spec decides may only repeat the spec's value.
    `trident plan SPEC --deepspeed-config` prints the config the ranks run with."""

    @field_validator("env")
    @classmethod
    def _env_keys(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 256:
            raise ValueError(f"at most 256 variables, got {len(v)}")
        for key, value in v.items():
            if not _ENV_KEY.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            env_value(key, value)
        return v

    @field_validator("secrets")
    @classmethod
    def _secret_keys(cls, v: dict[str, SecretStr]) -> dict[str, SecretStr]:
        # No value in a message: pydantic's own errors carry the input, the API drops it.
        if len(v) > MAX_SECRETS:
            raise ValueError(f"at most {MAX_SECRETS} secrets, got {len(v)}")
        for key, value in v.items():
            if not _ENV_KEY.match(key):
                raise ValueError(f"{key[:128]!r} is not a valid environment variable name")
            try:
                env_value(key, value.get_secret_value())
            except ValueError:
                raise ValueError(f"the value of secret {key} holds a control character (NUL,"
                                 " newline, ...); secrets are printable text") from None
        return v

    def secret_values(self) -> dict[str, str]:
        """The secrets' values by name (for the store's sealed copy and the ranks' env)."""
        return {k: v.get_secret_value() for k, v in self.secrets.items()}

    def with_secrets(self, values: Mapping[str, str]) -> JobSpec:
        """This spec carrying `values` as its secrets (checked when they were submitted)."""
        return self.model_copy(update={"secrets": {k: SecretStr(v) for k, v in values.items()}})

    @field_validator("deepspeed")
    @classmethod
    def _deepspeed_bounded(cls, v: dict[str, Any]) -> dict[str, Any]:
        ds_config.check_bounds(v)
        return v

    @field_validator("command")
    @classmethod
    def _command_text(cls, v: list[str] | None) -> list[str] | None:
        for i, arg in enumerate(v or []):
            try:
                env_value(f"argument {i}", arg)
            except ValueError:
                raise ValueError(f"argument {i} holds a control character (NUL, newline,"
                                 " ...); a command's arguments are printable text") from None
        return v

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, v: str | None) -> str | None:
        if v is not None and not _ENTRYPOINT.match(v):
            raise ValueError(f"{v!r} is not of the form 'package.module:function'")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        for name in sorted(set(self.secrets) & set(self.env)):
            raise SpecError(f"secrets.{name}", f"{name} is set in env too; a variable is"
                            " either a secret or not")
        for err in command_errors(self):
            raise err
        samples = self.train.steps * self.train.global_batch
        if self.data.corpora and samples > MAX_DATA_SAMPLES:
            raise SpecError("train.steps", f"steps({self.train.steps}) * global_batch"
                            f"({self.train.global_batch}) = {samples} samples exceed the"
                            f" {MAX_DATA_SAMPLES} a sample order of kind 'tokens' holds")
        for err in layout_errors(self) if self.model is not None else unplanned_errors(self):
            raise err
        workers = self.resources.workers
        if self.model is not None and workers is not None and workers != self.world_size:
            raise SpecError("resources.workers", f"workers({workers}) is not the job's"
                            f" {self.world_size} ranks (its layout's tp * pp * dp, or its"
                            " cluster's slots); a planned job's ranks are its layout's")
        for field, why in ds_config.section_errors(self):
            raise SpecError(field, why)
        return self

    @model_validator(mode="before")
    @classmethod
    def _place_unplanned(cls, data: Any) -> Any:
        # A command job without a model runs `resources.workers` data-parallel ranks: its
        # layout is written as that, so that the stored spec says what runs.
        if (isinstance(data, dict) and data.get("model") is None
                and data.get("command") is not None and "parallel" not in data):
            resources = data.get("resources")
            workers = _as_int(resources.get("workers") if isinstance(resources, dict)
                              else getattr(resources, "workers", None))
            if workers is not None and workers >= 1:
                return {**data, "parallel": {"dp": workers}}
        return data

    @property
    def planned_model(self) -> ModelSpec:
        """`model`, where only a planned job comes (the planner, the built-in trainer and an
        entrypoint's ranks, corpora): a ValueError on a command job without one."""
        if self.model is None:
            raise ValueError(f"job {self.name!r} gives no model: it is not planned")
        return self.model

    @property
    def planned(self) -> bool:
        """Whether the job is planned (memory checked, step predicted): it gives a `model`."""
        return self.model is not None

    @property
    def world_size(self) -> int:
        """Ranks the job runs on: the cluster's slots when given, else tp * pp * dp."""
        if self.cluster is not None:
            return self.cluster.nodes * self.cluster.gpus_per_node
        return self.layout.dims.world_size

    @property
    def target(self) -> ClusterSpec:
        """The hardware to plan for: `cluster`, or the job's own ranks on one node."""
        if self.cluster is not None:
            return self.cluster
        gpu = "cpu" if self.resources.gpus_per_worker == 0 else GPU_DEFAULT
        return ClusterSpec(gpu=gpu, nodes=1, gpus_per_node=self.world_size)

    @property
    def layout(self) -> ParallelSpec:
        """The explicit layout; only valid once `parallel` is not "auto"."""
        if isinstance(self.parallel, str):
            raise ValueError("parallel is 'auto': plan the job to choose a layout")
        return self.parallel


def command_errors(spec: JobSpec) -> list[SpecError]:
    """What a `command` job may not carry, and what only a `command` job may."""
    if spec.command is None:
        return [SpecError(name, f"{name} is for a command job (`command`)")
                for name in ("workdir", "progress") if getattr(spec, name) is not None]
    errs = [SpecError(name, f"command runs instead of {what}: give one of them")
            for name, what, on in (("entrypoint", "an entrypoint function",
                                    spec.entrypoint is not None),
                                   ("program", "the light rank program", spec.program is not None))
            if on]
    if spec.workdir is None:
        errs.append(SpecError("workdir", "a command needs the folder it starts in, inside the"
                              " server's code roots (TRIDENT_CODE_ROOTS)"))
    if spec.faults:
        errs.append(SpecError("faults", "faults are injected into Trident's own rank programs;"
                              " a command fails by itself"))
    if spec.data.kind != "synthetic":
        errs.append(SpecError("data.kind", "a command reads its own data; Trident's corpora"
                              " are for the built-in trainer"))
    return errs


def unplanned_errors(spec: JobSpec) -> list[SpecError]:
    """What a spec without `model` may not ask: only a command job may leave it out, and it
    is then placed from `resources.workers` alone (what needs a plan is refused)."""
    if spec.command is None:
        what = "an entrypoint" if spec.entrypoint is not None else "the built-in trainer"
        return [SpecError("model", f"{what} needs the model to train (a preset or its"
                          " dimensions); only a command job may leave it out")]
    workers = spec.resources.workers
    if workers is None:
        return [SpecError("resources.workers", "a command job without model is placed from"
                          " resources alone: give its ranks as resources.workers (or give"
                          " model and parallel to plan it)")]
    errs: list[SpecError] = []
    if spec.parallel != ParallelSpec(dp=workers):
        errs.append(SpecError("parallel", "parallel is planned against a model: give model"
                              f" with it, or leave it out to run resources.workers({workers})"
                              " data-parallel ranks unplanned"))
    refused = [("cluster", spec.cluster is not None, "cluster is the hardware a plan is made"
                " for"),
               ("elastic", spec.elastic is not None, "elastic moves re-plan the layout for the"
                " ranks left, which needs the model"),
               ("train.compile", spec.train.compile, "train.compile compiles the built-in"
                " trainer's blocks; a command builds its own model")]
    errs += [SpecError(f, f"{why}: a command job without model is not planned") for f, on, why
             in refused if on]
    return errs


def layout_errors(spec: JobSpec) -> list[SpecError]:
    """Every inconsistency between the layout and the rest of the spec, with arithmetic."""
    if isinstance(spec.parallel, str):
        if spec.cluster is None:
            return [SpecError("cluster", "parallel 'auto' needs a cluster (gpu, nodes,"
                              " gpus_per_node) to plan for")]
        return []
    p, m, t = spec.parallel, spec.model, spec.train
    assert m is not None, "layout_errors checks a planned spec"
    errs: list[SpecError] = []
    if spec.data.kind == "chat" and p.pp > 1:
        errs.append(SpecError("parallel.pp", f"pp({p.pp}): data kind 'chat' averages the loss over"
                              " the tokens that train in the global batch, which the pipeline"
                              " engines do not yet; train it with pp 1"))
    if m.heads % p.tp:
        errs.append(SpecError("parallel.tp", f"tp({p.tp}) does not divide heads({m.heads})"))
    elif m.kv_heads % p.tp:
        errs.append(SpecError("parallel.tp", f"tp({p.tp}) does not divide kv_heads({m.kv_heads})"))
    if m.ffn_hidden % p.tp:
        errs.append(SpecError("parallel.tp",
                              f"tp({p.tp}) does not divide ffn_hidden({m.ffn_hidden})"))
    errs += [SpecError(f, msg) for f, msg in layer_split_errors(m.layers, p.pp,
                                                                 p.virtual_stages, p.partition)]
    if p.virtual_stages > 1 and p.pp == 1:
        errs.append(SpecError("parallel.virtual_stages",
                              f"virtual_stages({p.virtual_stages}) needs pp > 1"))
    if t.global_batch % (t.micro_batch * p.dp):
        errs.append(SpecError(
            "train.global_batch",
            f"global_batch({t.global_batch}) is not divisible by micro_batch({t.micro_batch})"
            f" * dp({p.dp}) = {t.micro_batch * p.dp}"))
    if t.batch_ramp is not None:
        unit = t.micro_batch * p.dp
        for name in ("start", "increment"):
            value = getattr(t.batch_ramp, name)
            if value % unit:
                errs.append(SpecError(
                    f"train.batch_ramp.{name}", f"{name}({value}) is not divisible by"
                    f" micro_batch({t.micro_batch}) * dp({p.dp}) = {unit}: every batch of the"
                    " ramp is whole micro-batches on every replica"))
        if p.virtual_stages > 1:
            errs.append(SpecError("train.batch_ramp", "a batch ramp needs virtual_stages 1:"
                                  " the interleaved schedule keeps one micro-batch count"))
    if p.zero >= 2 and p.pp > 1:
        errs.append(SpecError(
            "parallel.zero",
            f"zero({p.zero}) with pp({p.pp}) > 1 is not supported by DeepSpeed's pipeline"
            " engine; use zero 0 or 1"))
    if p.offload != "none" and p.zero == 0:
        errs.append(SpecError("parallel.offload", f"offload={p.offload!r} needs zero >= 1"))
    if p.offload == "optimizer+params" and p.zero != 3:
        errs.append(SpecError("parallel.offload",
                              f"offload='optimizer+params' needs zero 3, got zero({p.zero})"))
    if p.sequence_parallel and p.tp == 1:
        errs.append(SpecError("parallel.sequence_parallel", "sequence_parallel needs tp > 1"))
    if t.compile:
        refused = [
            ("parallel.zero", p.zero == 3, "zero 3: its hooks gather and release the"
             " parameters inside each block, which the compiled graph does not see"),
            ("parallel.recompute", p.recompute != "none", f"recompute {p.recompute!r}: the"
             " activation checkpoint reruns the block outside the compiled graph"),
            ("parallel.virtual_stages", p.virtual_stages > 1,
             f"virtual_stages({p.virtual_stages}): the interleaved engine is not tested"
             " compiled"),
            ("entrypoint", spec.entrypoint is not None, "a custom entrypoint: it builds its"
             " own model"),
            ("command", spec.command is not None, "a command: it builds its own model")]
        errs += [SpecError(f, f"train.compile is not supported with {why}")
                 for f, on, why in refused if on]
    world = p.tp * p.pp * p.dp
    if world > MAX_WORLD:
        errs.append(SpecError("parallel", f"tp*pp*dp = {world} exceeds {MAX_WORLD} ranks"))
    elif spec.cluster is None and world > MAX_RANKS_PER_NODE:
        errs.append(SpecError(
            "cluster", f"tp({p.tp}) * pp({p.pp}) * dp({p.dp}) = {world} ranks need a cluster"
            " (gpu, nodes, gpus_per_node) to plan for: without one the ranks are planned as"
            f" one node, and a node has at most {MAX_RANKS_PER_NODE}"))
    if spec.elastic is not None:
        if spec.elastic.min_ranks > world:
            errs.append(SpecError("elastic.min_ranks", f"min_ranks({spec.elastic.min_ranks})"
                                  f" is more than the job's {world} ranks"))
        if not spec.checkpoint.every_steps:
            errs.append(SpecError("elastic", "elastic needs checkpoint.every_steps >= 1: a"
                                  " re-planned job resumes from its newest checkpoint"))
        if not spec.max_retries:
            errs.append(SpecError("max_retries", "elastic needs max_retries >= 1: the attempt"
                                  " that loses its ranks fails, and spends a retry as any"
                                  " failure does, before the job is re-planned"))
    for i, f in enumerate(spec.faults):
        if f.rank >= world:
            errs.append(SpecError(f"faults.{i}.rank",
                                  f"rank {f.rank} outside world size {world}"))
    if spec.cluster is not None and world != spec.world_size:
        errs.append(SpecError(
            "parallel",
            f"tp({p.tp}) * pp({p.pp}) * dp({p.dp}) = {world} != world size {spec.world_size}"
            f" (cluster.nodes({spec.cluster.nodes}) * cluster.gpus_per_node"
            f"({spec.cluster.gpus_per_node}))"))
    return errs
