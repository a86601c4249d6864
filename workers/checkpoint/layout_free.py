"""The layout-free checkpoint form: a DeepSpeed tag written under one layout (tp, pp, dp,
ZeRO 0-3) as pieces of full per-parameter tensors under `workers.checkpoint.full_state`'s
canonical names, converted once per tag by every rank of the job that resumes from it, each
rank its share of the tag's files (`workers.checkpoint.rank_form`, which says what
`step<N>.full/` holds; `workers.checkpoint.tag_read`, how each DeepSpeed file kind is read),
kept beside the tag, and loaded under any other layout of the model.

`load_into` gives every rank of the new layout its shard of each (`full_state.load_full`, the
form's `rank_form.FormSource`: only the runs of the files that meet the rank's slices are
read; under ZeRO-3 only the rows that hold the rank's partition of each parameter,
`_load_partitions`): the module's weights, the fp32 master copy (ZeRO 1/2: the parameter's
fragment of the flat fp32 partition, `safe_set_full_fp32_param`; ZeRO-3: its partition of the
sub-group's flat fp32 tensor), both moments (the same places in the optimizer's state,
created as Adam's first step would) and Adam's step count; the engine's step counters too. It
reads the form of before (one file per kind, written by rank 0 alone) as well.

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
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from workers.checkpoint.full_state import Entry, entries, load_full, partitioned, shard_index
from workers.checkpoint.rank_form import FormSource
from workers.checkpoint.rank_form import convert as convert  # one process, every unit
from workers.checkpoint.tag_forms import FULL as FULL
from workers.checkpoint.tag_read import KINDS as KINDS
from workers.checkpoint.tag_read import MOMENTS
from workers.checkpoint.tag_read import LayoutRefused as LayoutRefused
from workers.checkpoint.tag_read import canonical as canonical


def _load(path: str) -> Any:
    # Written by the job's own ranks.
    return torch.load(path, map_location="cpu", weights_only=False)


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


def _flat(source: Any, index: tuple[slice, ...], a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of the box `index` of `source` flattened, reading only the rows of
    its first dimension that hold them."""
    row = math.prod(s.stop - s.start for s in index[1:])
    r0, r1 = a // row, -(-b // row)
    first = index[0].start
    return source[(slice(first + r0, first + r1), *index[1:])].reshape(-1)[
        a - r0 * row:b - r0 * row]


def _partition(get_full: Any, e: Entry, tp_rank: int, tp: int, start: int,
               stop: int) -> torch.Tensor:
    """Elements [start, stop) of this rank's TP-local tensor of `e`, flattened (a fused one's
    projections stacked), read from the form's slices that hold them only."""
    local = tuple(e.param.ds_shape)  # type: ignore[attr-defined]  # ZeRO-3's full shape
    wanted = [(n, (rows, *local[1:])) for n, rows in e.parts] or [(e.name, local)]
    out, at = [], 0
    for name, mine in wanted:
        size = math.prod(mine)
        a, b = max(start, at), min(stop, at + size)
        if a < b:
            source = get_full(name)
            if source is None:
                raise ValueError(f"the layout-free form lacks {name}")
            index = shard_index(name, tuple(int(n) for n in source.shape), tp_rank, tp)
            if tuple(s.stop - s.start for s in index) != mine:
                raise ValueError(f"{name}: the form's shape {list(source.shape)} does not give"
                                 f" TP rank {tp_rank} of {tp} the model's {list(mine)}")
            out.append(_flat(source, index, a - at, b - at))
        at += size
    return torch.cat(out)


def _load_partitions(engine: Any, form: FormSource, groups: Any) -> None:
    """ZeRO-3: every parameter's partition of this rank (the module's, the flat fp32 master's,
    both moments'), each read from the form's runs that hold it, nothing more."""
    opt = engine.optimizer
    tp_rank, tp = (groups.tp_rank, groups.tp_size) if groups is not None else (0, 1)
    sources = {k: form.kind(k) for k in KINDS}
    for e in entries(engine.module):
        p = e.param
        group, offset, numel = opt.grad_position[opt.get_param_id(p)]
        flat = opt.fp32_partitioned_groups_flat[group]
        start = opt._get_param_partition_rank(p) * numel
        stop = min(start + numel, math.prod(p.ds_shape))  # type: ignore[attr-defined]
        if start >= stop:
            continue
        for kind, get_full in sources.items():
            part = _partition(get_full, e, tp_rank, tp, start, stop)
            target = flat if kind == "fp32" else opt.optimizer.state[flat][kind]
            target.data.narrow(0, offset, part.numel()).copy_(part.to(target.dtype))
            if kind == "fp32":
                module = p.ds_tensor  # type: ignore[attr-defined]
                module.data[:part.numel()].copy_(part.to(module.dtype))


def _or(master: nn.Parameter | None, p: nn.Parameter) -> nn.Parameter:
    return p if master is None else master


def load_into(engine: Any, folder: str, groups: Any) -> dict[str, Any]:
    """Every rank (not collective): the layout-free form `folder` into `engine` (DeepSpeed's,
    or `workers.trainer.interleaved`'s, whose torch optimizer keeps per-parameter state: see the
    module); its client state (`client.pt`)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

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
    form = FormSource(folder)

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
        if all(partitioned(p) for p in params):  # ZeRO-3: each rank's partitions alone
            _load_partitions(engine, form, groups)
        else:
            load_full(model, form.kind("fp32"), groups, assign=weights)
            for key in MOMENTS:
                load_full(model, form.kind(key), groups, assign=moment(key))
    form.close()
    _set_steps(base, step)
    engine.global_steps = int(client.get("global_steps") or client["step"])
    if client.get("global_samples") is not None:
        engine.global_samples = int(client["global_samples"])
    return client
