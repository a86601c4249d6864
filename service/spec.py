"""The job spec: what a user asks Trident to train, and how.

Accepted as JSON over REST and as YAML by the CLI. Field names are the public contract:
add fields freely, never rename. Every check that needs more than one field explains itself
with the arithmetic, and names the field, so the API can turn it into a 422.
"""

from __future__ import annotations

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

from service.hardware import PROFILES
from service.parallel import ParallelDims
from service.presets import PRESETS
from service.spec_limits import OsPath, RayQuantity, env_value
from service.spec_stack import Partition, Stack, layer_split_errors

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
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

MAX_WORLD = 65536
MAX_RANKS_PER_NODE = 64
MAX_MICRO_BATCH = 65536
Zero = Literal[0, 1, 2, 3]
Offload = Literal["none", "optimizer", "optimizer+params"]
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
               "activation")
"""The keys a preset supplies to a spec (`service.presets` holds more, for the planner)."""


class ModelSpec(_Strict):
    """A decoder-only transformer: a preset, explicit dimensions, or a preset with overrides.

    The preset is merged before the fields are validated, so a validated spec holds every
    dimension as a plain number, and its dump validates back to the same spec.
    """

    preset: str | None = None
    """Name of a preset shape (see `service.presets`); explicit fields below override it."""
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
    activation: Literal["gelu", "swiglu"] = "gelu"
    """MLP type: `gelu` (two matrices, GPT) or `swiglu` (three matrices, Llama)."""

    @model_validator(mode="before")
    @classmethod
    def _merge_preset(cls, data: Any) -> Any:
        preset = data.get("preset") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(preset, str | None):
            return data  # a validated ModelSpec, or a wrong type for pydantic to name
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
        if self.hidden % self.heads:
            raise ValueError(f"hidden({self.hidden}) is not divisible by heads({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads({self.heads}) is not divisible by kv_heads({self.kv_heads})")
        return self


class TrainSpec(_Strict):
    """The optimisation run."""

    steps: Annotated[int, Field(ge=1, le=10_000_000)] = 100
    """Optimizer steps to run."""
    global_batch: Annotated[int, Field(ge=1, le=1_048_576)] = 8
    """Sequences per optimizer step, across all data-parallel replicas."""
    micro_batch: Annotated[int, Field(ge=1, le=MAX_MICRO_BATCH)] = 1
    """Sequences per forward/backward pass on one rank."""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Arithmetic precision of weights and activations (optimizer states stay fp32)."""
    lr: Annotated[float, Field(gt=0, le=10)] = 3e-4
    """Peak learning rate (AdamW)."""
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 1234
    """Seed of initialisation and of the synthetic data."""
    stack: Stack = "trident"
    """Training software the planner models (speed, memory); Trident runs only `trident`."""


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


class CheckpointSpec(_Strict):
    """Periodic DeepSpeed checkpoints, used to resume a restarted attempt."""

    every_steps: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    """Save every this many steps; 0 saves none."""
    dir: OsPath | None = None
    """The job's own folder inside the checkpoint roots (default: `checkpoints/job-<id>` in the
    data directory); not a root, the data directory, nor another job's. 4095 bytes at most."""


class MonitorSpec(_Strict):
    """The health monitor: bandwidth probe, communication accounting, hangs, stragglers."""

    probe: bool = True
    """Probe every TP group, DP group and PP pair's bandwidth before training."""
    probe_max_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 64 << 20
    """Largest probe message (sizes run from 1 KiB in powers of 4 up to this)."""
    hang_timeout_s: Annotated[float, Field(ge=1, le=86400)] = 300.0
    """A job with no rank making progress for this long is hung: diagnosed and stopped."""
    comm_sample_every: Annotated[int, Field(ge=1, le=100000)] = 10
    """On GPUs, time collectives with CUDA events every this many steps."""
    straggler_threshold: Annotated[float, Field(gt=1, le=100)] = 1.25
    """A rank slower than this times its pipeline-stage peers' compute time is a straggler."""
    straggler_min_steps: Annotated[int, Field(ge=1, le=10000)] = 5
    """... for this many consecutive steps."""
    slow_group_threshold: Annotated[float, Field(gt=0, le=1)] = 0.5
    """A probed group below this fraction of the profile's expected bandwidth is flagged."""


class FaultSpec(_Strict):
    """A fault injected into one rank, for tests; refused unless the server allows faults."""

    kind: Literal["hang", "slow", "fail", "kill"]
    """hang: sleep `seconds` once, before the step's first collective (mid-step, after the
    forward pass has started); slow: the same on every step from `step` on; fail: raise;
    kill: end the rank's process."""
    rank: Annotated[int, Field(ge=0, le=65535)]
    """The rank to hit."""
    step: Annotated[int, Field(ge=1, le=10_000_000)]
    """The step at whose start the fault fires."""
    seconds: Annotated[float, Field(ge=0, le=86400)] = 0.0
    """Sleep length for hang and slow."""
    attempt: Annotated[int, Field(ge=1, le=1000)] = 1
    """The attempt it fires in (so that a restarted attempt can succeed)."""


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
    the server allows (`TRIDENT_MLFLOW_URIS`, checked by `service.confine`); default: the
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
    model: ModelSpec
    """The transformer to train."""
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
    max_retries: Annotated[int, Field(ge=0, le=100)] = 0
    """Restarts from the last checkpoint allowed after a recoverable failure."""
    env: dict[str, Annotated[str, Field(max_length=4096)]] = Field({}, json_schema_extra=_ENV)
    """Environment variables for every rank (e.g. NCCL_*); no LD_*, PYTHON*, PATH (admins).
    Readable by the job's owner and admins only (others see the names)."""
    secrets: dict[Annotated[str, Field(max_length=128)],
                  Annotated[SecretStr, Field(max_length=SECRET_MAX_CHARS)]] = Field(
        {}, exclude=True, json_schema_extra=_SECRETS)
    """Environment variables for every rank whose values are secret (tracker tokens, keys):
    write-only. Stored apart from the spec, encrypted (`service.secrets`), never returned by
    any route, page, event or export (their names are), given to the ranks' environment only.
    A dump of the spec leaves them out (`secret_values` reads them)."""
    tracking: TrackingSpec = TrackingSpec()
    """Where the job's metrics go: MLflow, TensorBoard files (`docs/tracking.md`)."""
    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0
    """Higher runs first among queued jobs."""
    entrypoint: Annotated[str, Field(max_length=512)] | None = None
    """Custom per-rank training function, "package.module:function"; default: built-in GPT."""
    monitor: MonitorSpec = MonitorSpec()
    """Health monitor settings."""
    faults: Annotated[list[FaultSpec], Field(max_length=16)] = Field(default_factory=list)
    """Faults to inject (tests only; the server must set TRIDENT_ALLOW_FAULTS)."""

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
        for err in layout_errors(self):
            raise err
        return self

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


def layout_errors(spec: JobSpec) -> list[SpecError]:
    """Every inconsistency between the layout and the rest of the spec, with arithmetic."""
    if isinstance(spec.parallel, str):
        if spec.cluster is None:
            return [SpecError("cluster", "parallel 'auto' needs a cluster (gpu, nodes,"
                              " gpus_per_node) to plan for")]
        return []
    p, m, t = spec.parallel, spec.model, spec.train
    errs: list[SpecError] = []
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
    world = p.tp * p.pp * p.dp
    if world > MAX_WORLD:
        errs.append(SpecError("parallel", f"tp*pp*dp = {world} exceeds {MAX_WORLD} ranks"))
    elif spec.cluster is None and world > MAX_RANKS_PER_NODE:
        errs.append(SpecError(
            "cluster", f"tp({p.tp}) * pp({p.pp}) * dp({p.dp}) = {world} ranks need a cluster"
            " (gpu, nodes, gpus_per_node) to plan for: without one the ranks are planned as"
            f" one node, and a node has at most {MAX_RANKS_PER_NODE}"))
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
