"""The layout-free checkpoint form: a DeepSpeed tag written under one layout (tp, pp, dp,
ZeRO 0-3) as full per-parameter tensors under `workers.checkpoint.full_state`'s canonical names,
converted once per tag by rank 0 and kept beside it, and loaded under any other layout of the model.

`step<N>.full/` holds:

- `fp32.safetensors`, `exp_avg.safetensors`, `exp_avg_sq.safetensors`: for every parameter its
  fp32 master weights and both Adam moments, whole (TP shards joined, pipeline stages gathered,
  ZeRO partitions joined);
- `client.pt`: the scalars and rank 0's client state (the step, Adam's step count, data
  position, consumed samples, RNG);
- `meta.json`: the layout that wrote the tag, the conversion's seconds and bytes.

`convert` reads the tag's files directly, as DeepSpeed's `ds_to_universal` does, without
torch.distributed: ZeRO 1/2 through each DP rank's flat fp32 partition and its
`param_slice_mappings` (the fragment of each parameter in it), ZeRO-3 through each DP rank's
`fp32_flat_groups` (each parameter's partition is ceil(numel / dp) long, in `param_shapes`
order), ZeRO 0 (fp32) through the torch optimizer's state in the model states file, by
position in AdamW's parameter groups (`workers.trainer.recipe.param_groups`; a pipeline's stages are
the runs of layer files whose parameters number what each stage's optimizer holds). The
model-parallel rank of a file is `stage * tp + tp_rank` (DeepSpeed's pipeline grid, axes pipe,
data, model). TP shards are joined by `full_state.join_shards`.

`load_into` gives every rank of the new layout its shard of each (`full_state.load_full`): the
module's weights, the fp32 master copy (ZeRO 1/2: the parameter's fragment of the flat fp32
partition, `safe_set_full_fp32_param`; ZeRO-3: its partition of the sub-group's flat fp32
tensor), both moments (the same places in the optimizer's state, created as Adam's first step
would) and Adam's step count; the engine's step counters too.

The interleaved engine (`workers.trainer.interleaved`, `virtual_stages` > 1) is loaded the same way
as ZeRO 0 (its torch AdamW, or ZeroRedundancyOptimizer's local one, keeps per-parameter state);
in bf16 the fp32 weights and the moments go to each parameter's fp32 master (`master_of`).

Not covered, refused by name (`LayoutRefused`): a tag written with interleaved stages (its
per-rank files are `workers.trainer.interleaved`'s, not read here); a ZeRO-0 tag in 16 bits (its
fp32 master weights are in DeepSpeed's FP16/BF16 optimizer state); resuming under ZeRO 0 in fp16
(FP16_Optimizer keeps its own flat fp32 copy). A bf16 tag carries its fp32 masters, not its
bf16 weights: those are the masters rounded, and the new layout rounds them again to the same
bits. Tested in fp32 and bf16 (tests/test_layout_free.py),
optimizer offload included on CPU ranks (a ZeRO-2 tag written with it, a resume under ZeRO-3
with optimizer and parameter offload: the tag's files and the engine's flat tensors are the
same with it, torch's AdamW stepping them on the host). On a GPU, offload steps with
DeepSpeedCPUAdam (`service.contract.ds_config`), whose state has the same names but is not tested
here.

One module because it is one format: what `convert` writes and what `load_into` reads must
agree field by field (names, dtypes, the optimizer's state layout per ZeRO stage), and each
reader of a DeepSpeed file kind sits beside the writer of the form it feeds.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from service.planner.shape import ModelShape
from workers.checkpoint.full_state import (
    LazySlice,
    entries,
    join_shards,
    load_full,
    partitioned,
    unfuse,
)
from workers.checkpoint.tag_forms import FULL, optim_states

KINDS = ("fp32", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")


class LayoutRefused(RuntimeError):
    """A tag this module cannot carry to another layout, and why."""


def _load(path: str) -> Any:
    # Written by the job's own ranks, which DeepSpeed itself loads the same way.
    return torch.load(path, map_location="cpu", weights_only=False)


def canonical(key: str, stage: int, pp: int, layers: int) -> str | None:
    """The canonical name of DeepSpeed's parameter `key` (its module name) of pipeline stage
    `stage` (None: a tied head's copy of the embedding)."""
    from workers.checkpoint.hf_export import canonical as of_layer

    if key.startswith("tied_modules."):  # tied_modules.<key>.<local>: embedding or head
        local = key.split(".", 2)[2]
        if stage == 0:
            return "embed." + local
        return None if local == "tok" else "head." + local
    if pp == 1:  # GPT: layers.<k>.<local>
        _, k, local = key.split(".", 2)
    else:  # PipelineModule: <k>.<local>, k the flat layer index
        k, local = key.split(".", 1)
    return of_layer(int(k), local, layers)


Shards = dict[str, dict[str, dict[int, torch.Tensor]]]
"""kind -> canonical name -> tp rank -> that rank's (TP-local, whole over DP) tensor."""


def _put(out: Shards, name: str | None, t: int, kind: str, tensor: torch.Tensor) -> None:
    if name is not None:
        out.setdefault(kind, {}).setdefault(name, {})[t] = tensor


def _zero12(path: str, m: int, dp: int, names: Callable[[str], str | None], t: int,
            out: Shards) -> float:
    """ZeRO 1/2: each DP rank's flat fp32 partition and its moments, cut by the parameter's
    fragment (`param_slice_mappings`); the fragments joined in DP order. Adam's step."""
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    step = 0.0
    for d in range(dp):
        osd = _load(optim_states(path, d, m, LayoutRefused))["optimizer_state_dict"]
        base = osd["base_optimizer_state"]
        state = base["state"] if isinstance(base, dict) else dict(enumerate(base))
        for gi, (flat, mapping) in enumerate(zip(osd["single_partition_of_fp32_groups"],
                                                 osd["param_slice_mappings"], strict=True)):
            st = state.get(gi, {})
            step = float(st.get("step", step))
            for key, frag in mapping.items():
                start, numel = int(frag.start), int(frag.numel)
                got = pieces.setdefault(key, {k: [] for k in KINDS})
                got["fp32"].append(flat.narrow(0, start, numel))
                for k in MOMENTS:
                    got[k].append(st[k].narrow(0, start, numel))
    shapes = _param_shapes(os.path.join(path, f"mp_rank_{m:02d}_model_states.pt"))
    for key, kinds in pieces.items():
        for k, parts in kinds.items():
            _put(out, names(key), t, k, torch.cat(parts).view(shapes[key]).clone())
    return step


def _param_shapes(path: str) -> dict[str, torch.Size]:
    shapes: dict[str, torch.Size] = {}
    for group in _load(path)["param_shapes"]:
        shapes.update(group)
    return shapes


def _zero3(path: str, m: int, dp: int, names: Callable[[str], str | None], t: int,
           out: Shards) -> float:
    """ZeRO-3: each parameter is ceil(numel / dp) elements of every DP rank's flat sub-group
    (its last part padded), the parameters in `param_shapes` order."""
    groups = _load(os.path.join(path, f"zero_pp_rank_0_mp_rank_{m:02d}_model_states.pt"))[
        "param_shapes"]
    flats: list[list[dict[str, torch.Tensor]]] = []  # dp rank -> sub-group -> kind -> flat
    step = 0.0
    for d in range(dp):
        osd = _load(optim_states(path, d, m, LayoutRefused))["optimizer_state_dict"]
        state = osd["optimizer_state_dict"]["state"]
        subs = []
        for gi, flat in enumerate(osd["fp32_flat_groups"]):
            st = state.get(gi, {})
            step = float(st.get("step", step))
            subs.append({"fp32": flat, **{k: st[k] for k in MOMENTS}})
        flats.append(subs)
    for gi, shapes in enumerate(groups):
        offset = 0
        for key, shape in shapes.items():
            numel = math.prod(shape)
            per = math.ceil(numel / dp)
            for k in KINDS:
                whole = torch.cat([flats[d][gi][k].narrow(0, offset, per) for d in range(dp)])
                _put(out, names(key), t, k, whole[:numel].view(shape).clone())
            offset += per
    return step


def _stage_layers(path: str, pp: int, tp: int, layers: int) -> list[dict[str, torch.Tensor]]:
    """A ZeRO-0 pipeline tag: each stage's parameters as its PipelineModule names them
    (`<k>.<local>`, a tied module's first), from the layer files of TP rank 0's shapes. The
    stages' layers are not recorded: each stage takes the next layers whose parameters
    number what its optimizer holds (stages are contiguous runs of layers)."""
    def layer(k: int, t: int) -> dict[str, torch.Tensor]:
        return dict(torch.load(os.path.join(path, f"layer_{k:02d}-model_{t:02d}"
                                                  "-model_states.pt"),
                               map_location="cpu", weights_only=True))
    counts = []
    for s in range(pp):
        opt = _load(os.path.join(path, f"mp_rank_{s * tp:02d}_model_states.pt"))["optimizer"]
        counts.append(sum(len(g["params"]) for g in opt["param_groups"]))
    sizes = [len(layer(k, 0)) for k in range(layers + 2)]
    out: list[list[int]] = []
    k = 0
    for s, want in enumerate(counts):
        got: list[int] = []
        while k < len(sizes) and sum(sizes[j] for j in got) < want:
            got.append(k)
            k += 1
        if sum(sizes[j] for j in got) != want:
            raise LayoutRefused(f"{path}: stage {s}'s optimizer holds {want} parameters, which"
                                " no run of its layers matches; not converted")
        out.append(got)
    if k != len(sizes):
        raise LayoutRefused(f"{path}: its stages' optimizers hold fewer parameters than its"
                            " layers; not converted")
    stages: list[dict[str, torch.Tensor]] = []
    for t in range(tp):
        for ks in out:
            # PipelineModule registers its tied modules (a tied head) before its layers.
            tied = [k for k in ks if k == layers + 1 and "tok" in layer(k, t)]
            ordered = tied + [k for k in ks if k not in tied]
            module: dict[str, torch.Tensor] = {}
            for k in ordered:
                for local, tensor in layer(k, t).items():
                    module[f"{k}.{local}"] = tensor
            stages.append(module)
    return stages  # index t * pp + s


def _zero0(path: str, m: int, names: Callable[[str], str | None], t: int, out: Shards,
           tag_path: str, module: dict[str, torch.Tensor] | None = None) -> float:
    """ZeRO 0 (fp32): the module's weights are the master weights; the torch AdamW state is
    keyed by position in `recipe.param_groups`' groups (decayed matrices, then the rest:
    vectors and the embedding's tables), each in module order. `module`: a pipeline stage's
    parameters (`_stage_layers`; pp = 1: the model states file's module)."""
    sd = _load(os.path.join(path, f"mp_rank_{m:02d}_model_states.pt"))
    module, opt = (sd["module"] if module is None else module), sd.get("optimizer")
    if opt is None or module is None:
        raise LayoutRefused(f"{tag_path}: no module or optimizer state in its model states"
                            " file")
    if any(t.dtype != torch.float32 for t in module.values() if t.is_floating_point()):
        raise LayoutRefused(f"{tag_path}: a ZeRO-0 tag in 16 bits keeps its fp32 master"
                            " weights in DeepSpeed's own optimizer state; not converted")
    order: list[str] = []
    seen: set[int] = set()
    for key, tensor in module.items():
        if key in (sd.get("buffer_names") or []) or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        order.append(key)
    groups = opt["param_groups"]
    if len(groups) > 1:
        def plain(key: str) -> bool:
            name = names(key)
            return module[key].dim() < 2 or name is None or name.startswith("embed.")
        order = [k for k in order if not plain(k)] + [k for k in order if plain(k)]
    index = [i for g in groups for i in g["params"]]
    if len(index) != len(order):
        raise LayoutRefused(f"{tag_path}: the optimizer holds {len(index)} parameters, the"
                            f" module {len(order)}")
    step = 0.0
    for i, key in zip(index, order, strict=True):
        st = opt["state"].get(i)
        tensor = module[key].float()
        if st is None or tuple(st["exp_avg"].shape) != tuple(tensor.shape):
            raise LayoutRefused(f"{tag_path}: the optimizer state of parameter {i} does not"
                                f" fit {key} {list(tensor.shape)}")
        step = float(st["step"])
        _put(out, names(key), t, "fp32", tensor.clone())
        for k in MOMENTS:
            _put(out, names(key), t, k, st[k].float().clone())
    return step


def _unfused(shards: dict[str, dict[int, torch.Tensor]], shape: ModelShape,
             tp: int) -> dict[str, dict[int, torch.Tensor]]:
    """One kind's shards with each fused parameter's cut into its projections'."""
    out: dict[str, dict[int, torch.Tensor]] = {}
    for name, parts in shards.items():
        for t, tensor in parts.items():
            for part, piece in unfuse(name, tensor, shape, tp):
                out.setdefault(part, {})[t] = piece
    return out


def convert(directory: str, step: int, shape: ModelShape) -> tuple[str, float, int]:
    """Rank 0: tag `step` of `directory` in the layout-free form, written into a temporary
    folder and renamed (a conversion cut short is done again); cached: the second call
    converts nothing. Its folder, the seconds the conversion took (0.0: cached) and its bytes.
    `shape`: the model's (its blocks, and the rows of its fused projections, which the form
    holds apart under their canonical names: `full_state.unfuse`; a tag written before the
    fusion holds them apart already)."""
    from safetensors.torch import save_file

    from service.files.checkpoint_tags import tag
    from workers.checkpoint.tag_forms import flat_layout, tree_bytes

    tag_path = os.path.join(directory, tag(step))
    out = tag_path + FULL
    if os.path.isdir(out):
        return out, 0.0, tree_bytes(out)
    wrote = flat_layout(directory, step, LayoutRefused, "its per-rank files are"
                        " torch.distributed.pipelining's, not converted")
    tp, pp, dp, zero = (int(wrote[k]) for k in ("tp", "pp", "dp", "zero"))
    layers = shape.layers
    started = time.monotonic()
    stages = _stage_layers(tag_path, pp, tp, layers) if zero == 0 and pp > 1 else None
    shards: Shards = {}
    adam_step = 0.0
    for s in range(pp):
        for t in range(tp):
            m = s * tp + t

            def names(key: str, s: int = s) -> str | None:
                return canonical(key, s, pp, layers)

            if zero == 3:
                adam_step = _zero3(tag_path, m, dp, names, t, shards)
            elif zero in (1, 2):
                adam_step = _zero12(tag_path, m, dp, names, t, shards)
            else:
                adam_step = _zero0(tag_path, m, names, t, shards, tag_path,
                                   stages[t * pp + s] if stages is not None else None)
    first = os.path.join(tag_path, "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero == 3
                         else "mp_rank_00_model_states.pt")
    client = _load(first)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for kind in KINDS:
        full = {}
        for name, parts in _unfused(shards.get(kind, {}), shape, tp).items():
            if sorted(parts) != list(range(tp)):
                raise LayoutRefused(f"{tag_path}: {name} has TP shards {sorted(parts)}, not"
                                    f" 0..{tp - 1}")
            full[name] = join_shards(name, [parts[t] for t in range(tp)]).contiguous()
        save_file(full, os.path.join(tmp, f"{kind}.safetensors"))
    torch.save({"step": client.get("step", step), "adam_step": adam_step,
                "data_position": client.get("data_position", step),
                "consumed_samples": client.get("consumed_samples"),
                "global_steps": client.get("global_steps", step),
                "global_samples": client.get("global_samples"),
                "rng": client.get("rng")}, os.path.join(tmp, "client.pt"))
    took = time.monotonic() - started
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"written_by": wrote, "seconds": took, "bytes": tree_bytes(tmp)}, f)
    os.replace(tmp, out)
    return out, took, tree_bytes(out)


# --- loading under the new layout ---------------------------------------------------------------



def _source(handle: Any) -> Callable[[str], LazySlice | None]:
    keys = set(handle.keys())
    return lambda name: LazySlice(handle.get_slice(name)) if name in keys else None


def _scalar_step(like: Any, step: float) -> Any:
    return torch.full_like(like, step) if torch.is_tensor(like) else type(like)(step)


def _ensure_state(base: torch.optim.Optimizer, flats: list[torch.Tensor]) -> None:
    """Adam's state of each flat tensor, created as its first step would (zeros)."""
    for flat in flats:
        st = base.state[flat]
        if "exp_avg" not in st:
            st["step"] = torch.tensor(0.0)
            for k in MOMENTS:
                st[k] = torch.zeros_like(flat, memory_format=torch.preserve_format)


def _set_steps(base: torch.optim.Optimizer, step: float) -> None:
    for st in base.state.values():
        if "step" in st:
            st["step"] = _scalar_step(st["step"], step)
    for group in base.param_groups:  # DeepSpeed's FusedAdam counts per group
        if "step" in group:
            group["step"] = _scalar_step(group["step"], step)


def _z3_set(opt: Any, p: nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    """This rank's ZeRO-3 partition of `value` (p's TP-local tensor) into the sub-group's flat
    fp32 tensor (key None) or its Adam state `key`."""
    group, offset, numel = opt.grad_position[opt.get_param_id(p)]
    flat = opt.fp32_partitioned_groups_flat[group]
    target = flat if key is None else opt.optimizer.state[flat][key]
    rank = opt._get_param_partition_rank(p)
    whole = value.reshape(-1).to(target.dtype)
    part = whole[rank * numel:(rank + 1) * numel]
    target.data.narrow(0, offset, part.numel()).copy_(part.to(target.device))


def _or(master: nn.Parameter | None, p: nn.Parameter) -> nn.Parameter:
    return p if master is None else master


def load_into(engine: Any, folder: str, groups: Any) -> dict[str, Any]:
    """Every rank (not collective): the layout-free form `folder` into `engine` (DeepSpeed's,
    or `workers.trainer.interleaved`'s, whose torch optimizer keeps per-parameter state: see the
    module); its client state (`client.pt`)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from safetensors import safe_open

    from workers.monitor.memory import innermost_optimizer

    client = _load(os.path.join(folder, "client.pt"))
    step = float(client["adam_step"])
    model = engine.module
    opt = engine.optimizer
    base = innermost_optimizer(opt)
    params = [e.param for e in entries(model)]

    def master(p: nn.Parameter) -> nn.Parameter | None:
        """The interleaved engine's fp32 master of `p` in bf16 (its optimizer's parameter)."""
        return engine.master_of(p) if hasattr(engine, "master_of") else None
    if any(partitioned(p) for p in params):  # ZeRO-3
        _ensure_state(base, list(opt.fp32_partitioned_groups_flat))
    elif any(hasattr(p, "_hp_mapping") for p in params):  # ZeRO 1/2, bf16
        flats = getattr(opt, "single_partition_of_fp32_groups", None) or \
            getattr(opt, "fp32_groups_flat_partition", None)
        if flats is None:
            raise LayoutRefused(f"{type(opt).__name__}: its flat fp32 partitions are not"
                                " where ZeRO 1/2 keeps them; not loaded")
        _ensure_state(base, list(flats))
        opt._lazy_init_hp_params_optimizer_state()
    elif master(params[0]) is None and any(p.dtype != torch.float32
                                           for p in model.parameters()):
        raise LayoutRefused(f"ZeRO 0 with {type(opt).__name__} in 16 bits: its own fp32 copy"
                            " is not loaded from the layout-free form")
    # The parameters whose state this rank's torch optimizer keeps (ZeroRedundancyOptimizer:
    # its shard of them).
    owned = {id(p) for g in base.param_groups for p in g["params"]}
    files = {k: safe_open(os.path.join(folder, f"{k}.safetensors"), framework="pt")
             for k in KINDS}

    def weights(p: nn.Parameter, shard: torch.Tensor) -> None:
        from workers.checkpoint.full_state import assign_param
        assign_param(p, shard)  # the module's copy (the ZeRO-3 partition when partitioned)
        if partitioned(p):
            _z3_set(opt, p, shard, None)
        elif hasattr(p, "_hp_mapping"):
            safe_set_full_fp32_param(p, shard.to(torch.float32))
        elif (m := master(p)) is not None:
            m.data.copy_(shard.to(torch.float32))

    def moment(key: str) -> Callable[[nn.Parameter, torch.Tensor], None]:
        def assign(p: nn.Parameter, shard: torch.Tensor) -> None:
            if partitioned(p):
                _z3_set(opt, p, shard, key)
            elif hasattr(p, "_hp_mapping"):
                safe_set_full_optimizer_state(p, shard.to(torch.float32), key)
            elif id(q := _or(master(p), p)) in owned:  # ZeRO 0: the torch optimizer's own
                st = base.state[q]                          # per-parameter state
                if "exp_avg" not in st:
                    st["step"] = torch.tensor(0.0)
                    for k in MOMENTS:
                        st[k] = torch.zeros_like(q, memory_format=torch.preserve_format)
                st[key].copy_(shard.to(st[key].dtype))
        return assign

    with torch.no_grad():
        load_full(model, _source(files["fp32"]), groups, assign=weights)
        for key in MOMENTS:
            load_full(model, _source(files[key]), groups, assign=moment(key))
    _set_steps(base, step)
    engine.global_steps = int(client.get("global_steps") or client["step"])
    if client.get("global_samples") is not None:
        engine.global_samples = int(client["global_samples"])
    return client
