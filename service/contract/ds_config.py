"""The DeepSpeed config a job's ranks pass to `deepspeed.initialize`, and the spec's
`deepspeed:` section: the keys of a user's `ds_config.json` that do not decide the layout.

`deepspeed_config(spec)` is the config of an explicit layout: batch sizes, AdamW, precision,
ZeRO over DP, gradient clipping (`workers.trainer.train` passes exactly this; `trident plan SPEC
--deepspeed-config` prints it), with the spec's `deepspeed` section merged in.

The section (`JobSpec.deepspeed`) takes the keys of `ALLOWED` (top level) and
`ALLOWED_ZERO` (under `zero_optimization`): bucket sizes, communication overlap and dtype, and
the like, which tune how DeepSpeed moves bytes, not what is trained or where. A key the spec
decides (batch sizes, ZeRO stage, offload, precision, optimizer, schedule, clipping, the
pipeline) is accepted only with the value the spec gives it, and otherwise refused naming the
key and the spec field that decides it (`section_errors`); any other key is refused with the
allow list. An allowed key's value is one DeepSpeed takes (`VALUES`): what its ZeRO config
model (`deepspeed.runtime.zero.config.DeepSpeedZeroConfig`, pydantic) accepts, and for the top
level what `deepspeed.runtime.config` reads without failing, so that a value the ranks would
refuse at `deepspeed.initialize` (or fail on at their first step) is a 422 at submission.
The service does not import deepspeed: the rules are written here, and
tests/test_ds_config.py holds them against DeepSpeed's own.

Imported by `service.contract.spec` (checks), `service.planner` (the printed config) and
`workers.trainer.train` (the ranks' config).
"""

from __future__ import annotations

from typing import Any

JobSpec = Any
"""A validated `service.contract.spec.JobSpec` (not imported: the spec imports this module's
checks)."""

ALLOWED: frozenset[str] = frozenset({
    "communication_data_type", "prescale_gradients", "gradient_predivide_factor",
    "wall_clock_breakdown", "memory_breakdown", "steps_per_print", "dump_state",
    "seq_parallel_communication_data_type"})
"""Top-level keys a `deepspeed:` section may set."""
ALLOWED_ZERO: frozenset[str] = frozenset({
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
    "reduce_bucket_size", "contiguous_gradients", "round_robin_gradients",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "sub_group_size", "use_multi_rank_bucket_allreduce",
    "stage3_gather_16bit_weights_on_model_save"})
"""Keys under `zero_optimization` a `deepspeed:` section may set."""
DECIDED: dict[str, str] = {
    "train_batch_size": "train.global_batch",
    "train_micro_batch_size_per_gpu": "train.micro_batch",
    "gradient_accumulation_steps": "train.global_batch / (train.micro_batch * parallel.dp)",
    "optimizer": "train.lr, train.betas, train.eps, train.weight_decay",
    "scheduler": "train.warmup_steps, train.decay, train.decay_steps, train.min_lr",
    "bf16": "train.precision", "fp16": "train.precision", "amp": "train.precision",
    "gradient_clipping": "train.grad_clip",
    "pipeline": "parallel.pp, parallel.sequence_parallel",
    "zero_optimization.stage": "parallel.zero",
    "zero_optimization.offload_optimizer": "parallel.offload",
    "zero_optimization.offload_param": "parallel.offload",
}
"""Keys the spec decides, and the spec fields that decide them."""


def _boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def _whole(least: int) -> Any:
    """A whole number of at least `least` (DeepSpeed's `int` with `ge`/`gt`; `5e8`, a whole
    float, as pydantic takes it)."""
    def check(v: Any) -> str | None:
        whole = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        if isinstance(v, bool) or not whole or v < least:
            return f"must be a whole number of at least {least}"
        return None
    return check


def _positive(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
        return "must be a number above 0"
    return None


def _dtype(v: Any) -> str | None:
    if v is None or (isinstance(v, str) and v.lower() in ("fp16", "bf16", "fp32")):
        return None
    return "must be fp16, bf16, fp32 or null"


def _steps(v: Any) -> str | None:
    return None if v is None else _whole(1)(v)


def _optional_boolean(v: Any) -> str | None:
    return None if v is None else _boolean(v)


VALUES: dict[str, Any] = {
    # top level: deepspeed.runtime.config reads these without a check of its own, and the
    # engine divides by the factor and takes the step count modulo the print interval
    "communication_data_type": _dtype, "seq_parallel_communication_data_type": _dtype,
    "prescale_gradients": _boolean, "gradient_predivide_factor": _positive,
    "wall_clock_breakdown": _boolean, "memory_breakdown": _boolean, "dump_state": _boolean,
    "steps_per_print": _steps,
    # zero_optimization: DeepSpeedZeroConfig's fields (bool; int with ge=0, reduce_bucket_size
    # gt=0; overlap_comm Optional[bool])
    "zero_optimization.allgather_partitions": _boolean,
    "zero_optimization.allgather_bucket_size": _whole(0),
    "zero_optimization.overlap_comm": _optional_boolean,
    "zero_optimization.reduce_scatter": _boolean,
    "zero_optimization.reduce_bucket_size": _whole(1),
    "zero_optimization.contiguous_gradients": _boolean,
    "zero_optimization.round_robin_gradients": _boolean,
    "zero_optimization.stage3_max_live_parameters": _whole(0),
    "zero_optimization.stage3_max_reuse_distance": _whole(0),
    "zero_optimization.stage3_prefetch_bucket_size": _whole(0),
    "zero_optimization.stage3_param_persistence_threshold": _whole(0),
    "zero_optimization.sub_group_size": _whole(0),
    "zero_optimization.use_multi_rank_bucket_allreduce": _boolean,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _boolean,
}
"""Each allowed key's check: None when DeepSpeed takes the value, else why not."""


def value_refusal(key: str, value: Any) -> str | None:
    """Why DeepSpeed would refuse `value` for the allowed key `key` (dotted under
    `zero_optimization`), or None."""
    why = VALUES[key](value)
    return None if why is None else f"{key}={str(value)[:80]} {why}"
MAX_KEYS = 64
"""Most keys a `deepspeed:` section may hold, counted at every depth."""
MAX_DEPTH = 3
"""Deepest nesting of objects in the section (`zero_optimization.offload_param.device`)."""
MAX_NAME = 64
"""Longest key, and longest string value."""


def check_bounds(section: dict[str, Any]) -> None:
    """ValueError unless `section` is JSON of at most `MAX_KEYS` keys, `MAX_DEPTH` levels,
    names and strings of at most `MAX_NAME` characters, numbers, booleans and nulls."""
    count = 0

    def walk(value: Any, depth: int) -> None:
        nonlocal count
        if isinstance(value, dict):
            if depth > MAX_DEPTH:
                raise ValueError(f"nested more than {MAX_DEPTH} levels")
            for k, v in value.items():
                count += 1
                if count > MAX_KEYS:
                    raise ValueError(f"more than {MAX_KEYS} keys")
                if not isinstance(k, str) or len(k) > MAX_NAME:
                    raise ValueError(f"key {str(k)[:80]!r} is not a name of at most {MAX_NAME}"
                                     " characters")
                walk(v, depth + 1)
        elif isinstance(value, list):
            if len(value) > 16 or not all(isinstance(x, int | float) for x in value):
                raise ValueError("holds a list other than of at most 16 numbers")
        elif isinstance(value, str) and len(value) > MAX_NAME:
            raise ValueError(f"a string value is longer than {MAX_NAME} characters")
        elif value is not None and not isinstance(value, bool | int | float | str):
            raise ValueError(f"holds a {type(value).__name__}")

    walk(section, 1)


def base_config(spec: JobSpec, cuda: bool = False) -> dict[str, Any]:
    """The config the spec alone decides (see `deepspeed_config`)."""
    p, t = spec.layout, spec.train
    torch_adam = not (cuda and p.offload != "none")
    zero: dict[str, Any] = {"stage": p.zero}
    if p.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu"}
    if p.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.global_batch // (t.micro_batch * p.dp),
        "optimizer": {"type": "AdamW",
                      "params": {"lr": t.lr, "betas": list(t.betas), "eps": t.eps,
                                 "weight_decay": t.weight_decay, "torch_adam": torch_adam}},
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "initial_scale_power": 12},
        "gradient_clipping": t.grad_clip,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # The pipeline engine may send 1/tp of each activation and all-gather it on receipt,
        # which assumes activations replicated over TP; with sequence parallelism they are not.
        "pipeline": {"pipe_partitioned": not p.sequence_parallel,
                     "grad_partitioned": not p.sequence_parallel},
    }


def deepspeed_config(spec: JobSpec, cuda: bool = False) -> dict[str, Any]:
    """The DeepSpeed config of this layout, the `deepspeed:` section merged in.

    AdamW is torch's own, except with CPU offload on a GPU (`cuda`), where DeepSpeed's
    vectorised DeepSpeedCPUAdam steps the offloaded states (on a CPU-only rank the states live
    in CPU memory anyway, and torch's AdamW needs no compiled op). The rate in it is the peak;
    the trainer sets each step's rate from the schedule (`workers.trainer.recipe`)."""
    config = base_config(spec, cuda)
    for key, value in spec.deepspeed.items():
        if key == "zero_optimization":
            config["zero_optimization"] = {**value, **config["zero_optimization"]}
        elif key not in DECIDED:
            config[key] = value
    return config


def section_errors(spec: JobSpec) -> list[tuple[str, str]]:
    """(field, reason) for each key of `spec.deepspeed` that is not allowed or contradicts the
    spec; layout keys are compared only once the layout is explicit."""
    errs: list[tuple[str, str]] = []
    section = spec.deepspeed
    explicit = not isinstance(spec.parallel, str)
    base = base_config(spec) if explicit else {}
    for key, value in section.items():
        field = f"deepspeed.{key}"
        if key == "zero_optimization":
            if not isinstance(value, dict):
                errs.append((field, "is an object of ZeRO settings"))
                continue
            for sub, v in value.items():
                name = f"zero_optimization.{sub}"
                if name in DECIDED:
                    if explicit and v != base["zero_optimization"].get(sub):
                        errs.append((f"deepspeed.{name}", _contradiction(
                            name, v, base["zero_optimization"].get(sub))))
                elif sub not in ALLOWED_ZERO:
                    errs.append((f"deepspeed.{name}", _not_allowed(name, ALLOWED_ZERO)))
                elif why := value_refusal(name, v):
                    errs.append((f"deepspeed.{name}", why))
        elif key in DECIDED:
            if not explicit or not _agrees(value, base.get(key)):
                errs.append((field, _contradiction(key, value, base.get(key))))
        elif key not in ALLOWED:
            errs.append((field, _not_allowed(key, ALLOWED | {"zero_optimization"})))
        elif why := value_refusal(key, value):
            errs.append((field, why))
    return errs


def _agrees(given: Any, decided: Any) -> bool:
    """A key the spec decides may repeat the spec's value (an object: any of its keys)."""
    if isinstance(given, dict) and isinstance(decided, dict):
        return all(k in decided and _agrees(v, decided[k]) for k, v in given.items())
    return bool(given == decided)


def _contradiction(key: str, value: Any, decided: Any) -> str:
    spec_says = "the layout is 'auto'" if decided is None else \
        f"the spec makes it {str(decided)[:200]}"
    return (f"{key}={str(value)[:200]} contradicts {DECIDED[key]}: {spec_says}; set"
            f" {DECIDED[key]} in the spec instead")


def _not_allowed(key: str, allowed: frozenset[str]) -> str:
    return (f"{key} is not a key Trident passes through; allowed: {', '.join(sorted(allowed))}"
            f" (the spec decides {', '.join(sorted(DECIDED))})")
