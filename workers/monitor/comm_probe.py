"""Collective bandwidth probe: how fast each TP group, DP group and PP neighbour pair really is.

Called on every rank of a worker group before training (unless the job turns the probe off),
again at step boundaries during training (`workers.monitor.probe_rounds`), and by `trident
probe` across the cluster: `probe_layout(dims, rank)` after `init_process_group`, and
`probe_hosts` for the links between hosts (pairs of ranks on different hosts). Every rank
must call it (the groups are built collectively); each group's first rank (and each pair's
sender) returns the rows, the others return []. The caller gathers the rows of all ranks, and
`service.monitor.probe.flag_slow_groups` and `service.monitor.links.judge_links` judge them.

Rows are JSON-ready: `{dim, group, op, bytes, time_s, algbw, busbw, iters}`, with nccl-tests
definitions: `bytes` is the all-reduce tensor, the gathered all-gather output, the full
reduce-scatter input, the sent tensor; time is the slowest rank's mean over the timed
iterations; algbw = bytes / time_s; busbw = algbw * factor(op, n).

Backends: all-gather and reduce-scatter use the single-tensor forms (`all_gather_single` /
`reduce_scatter_single` in torch 2.13, `all_gather_into_tensor` / `reduce_scatter_tensor`
before). gloo in torch 2.13 supports them (checked on 2 ranks); where a backend raises for
them the probe falls back to the list forms (`all_gather`, `reduce_scatter`) and marks the
rows `"impl": "list"`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from service.contract.parallel import Dim, ParallelDims
from service.monitor.bandwidth import busbw_factor
from workers.runtime.heartbeat import Heartbeat

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = [KiB * 4**i for i in range(9)]  # 1 KiB .. 64 MiB
DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter")
BYTES_PER_POINT = 1 << 30
"""Iterations at large sizes are capped so one (op, size) moves about this many bytes."""

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _iters_for(nbytes: int, iters: int) -> int:
    return max(3, min(iters, -(-BYTES_PER_POINT // nbytes)))


JOB_PROBE_POINT_S = 0.05
"""A job's probe before training spends about this long on each (op, size) point beyond its
first call (a point whose first call took longer is timed by that call): on gloo a 64 MiB
collective takes a tenth of a second or more, and twenty of them at each of nine sizes and
three ops held the first step back by 10 s. `trident probe` keeps the full iteration counts."""


def job_sizes(max_bytes: int) -> list[int]:
    """The message sizes of a job's probe before training: those of `trident probe`
    (`DEFAULT_SIZES`) up to `max_bytes`, the largest and every other one below it (a factor
    of 16 apart: 1 KiB, 16 KiB, 256 KiB, 4 MiB, 64 MiB by default). They still span the
    latency-bound and the bandwidth-bound ends, and the group is judged at the largest
    (`service.monitor.probe`); each size is three collectives, each a barrier and a
    slowest-rank reduction besides its own calls, and the nine sizes of `trident probe` held
    the first step back by 1.5 s on two CPU ranks (gloo, 64 MiB: `docs/benchmarks.md`)."""
    sizes = [s for s in DEFAULT_SIZES if s <= max_bytes]
    return sorted(sizes[::-2])


def _budgeted(first_s: float, nbytes: int, iters: int, warmup: int,
              point_s: float | None) -> tuple[int, int]:
    """(further warm-up calls, timed calls) for a point whose first call took `first_s` (the
    slowest rank's, so that every rank agrees): within `point_s` when one is given. A point
    whose first call alone took the budget is timed by that call: (0, 0). Its links are warm
    from the smaller sizes before it, and a second call would double the probe's longest
    points (on gloo, 64 MiB collectives of a tenth of a second or more)."""
    k = _iters_for(nbytes, iters)
    if point_s is None:
        return warmup - 1, k
    calls = int(point_s / max(first_s, 1e-9))
    if calls == 0:
        return 0, 0
    return min(warmup - 1, calls - 1), min(k, calls)


def _op_fn(op: str, nbytes: int, n: int, group: Any, device: torch.device,
           use_list: bool) -> Callable[[], Any]:
    """A closure that runs `op` once on preallocated float32 buffers of nccl-tests size."""
    numel = max(n, nbytes // 4 // n * n)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    chunk = torch.empty(numel // n, dtype=torch.float32, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        if use_list:
            parts = list(full.chunk(n))
            return lambda: dist.all_gather(parts, chunk, group=group)
        return lambda: _ALL_GATHER(full, chunk, group=group)
    if op == "reduce_scatter":
        if use_list:
            parts = list(full.chunk(n))
            return lambda: dist.reduce_scatter(chunk, parts, group=group)
        return lambda: _REDUCE_SCATTER(chunk, full, group=group)
    raise ValueError(f"unknown probe op {op!r}; known: {DEFAULT_OPS}")


def _row(dim: str, ranks: Sequence[int], op: str, nbytes: int, time_s: float,
         iters: int) -> dict[str, Any]:
    alg = nbytes / time_s
    return {"dim": dim, "group": list(ranks), "op": op, "bytes": nbytes, "time_s": time_s,
            "algbw": alg, "busbw": alg * busbw_factor(op, len(ranks)), "iters": iters}


def probe_group(group: Any, ranks: Sequence[int], *, dim: str = "",
                sizes: Iterable[int] = DEFAULT_SIZES, ops: Iterable[str] = DEFAULT_OPS,
                iters: int = 20, warmup: int = 3, point_s: float | None = None,
                heartbeat: Heartbeat | None = None) -> list[dict[str, Any]]:
    """Time `ops` at each size over `group` (global `ranks`); called by every member. With
    `point_s`, the calls after the first at each point fit about that many seconds."""
    n = len(ranks)
    device = _device(group)
    me = dist.get_rank()
    rows = []
    for op in ops:
        use_list = False
        for nbytes in sizes:
            fn = _op_fn(op, nbytes, n, group, device, use_list)
            if heartbeat is not None:
                heartbeat.entering(op, dim or None, ranks)
            if point_s is not None:  # the first call may be the measurement: start together
                dist.barrier(group=group)
            t0 = time.perf_counter()
            try:
                fn()
            except (RuntimeError, NotImplementedError):
                if use_list or op == "all_reduce":
                    raise
                use_list = True  # this backend lacks the single-tensor form
                fn = _op_fn(op, nbytes, n, group, device, use_list)
                t0 = time.perf_counter()
                fn()
            _sync(device)
            first = time.perf_counter() - t0
            if point_s is not None:  # every rank must run the same calls
                first = _slowest(first, group, device)
            more, k = _budgeted(first, nbytes, iters, warmup, point_s)
            if k == 0:
                elapsed = first  # the slowest rank's already
            else:
                for _ in range(more):
                    fn()
                dist.barrier(group=group)
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(k):
                    fn()
                _sync(device)
                elapsed = _slowest((time.perf_counter() - t0) / k, group, device)
            if heartbeat is not None:
                heartbeat.left()
            if me == ranks[0]:
                row = _row(dim, ranks, op, nbytes, elapsed, max(k, 1))
                if use_list:
                    row["impl"] = "list"
                rows.append(row)
    return rows


def _slowest(seconds: float, group: Any, device: torch.device) -> float:
    """The group's largest `seconds` (one small all-reduce; every member calls it)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def probe_pair(src: int, dst: int, *, sizes: Iterable[int] = DEFAULT_SIZES, iters: int = 20,
               warmup: int = 3, dim: str = "pp", device: torch.device | None = None,
               point_s: float | None = None,
               heartbeat: Heartbeat | None = None,
               fastest: bool = False) -> list[dict[str, Any]]:
    """send/recv between global ranks `src` and `dst` (called by both): ping-pong, one-way
    time = round trip / 2 measured on `src`, which returns the rows. With `point_s`, `src`
    times the first round trip and sends `dst` the counts that fit about that long. The time
    is the round trips' mean, or with `fastest` the fastest one's: what the link can carry,
    which a moment's stall of either process (a busy host's scheduler) does not lower, and
    which a link limited to a slower rate never reaches (`probe_hosts`)."""
    me = dist.get_rank()
    assert me in (src, dst)
    peer = dst if me == src else src
    device = device or _device(None)
    rows = []
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)

        def once(buf: torch.Tensor = buf) -> None:
            if me == src:
                dist.send(buf, dst=peer)
                dist.recv(buf, src=peer)
            else:
                dist.recv(buf, src=peer)
                dist.send(buf, dst=peer)

        if heartbeat is not None:
            heartbeat.entering("send" if me == src else "recv", dim, [src, dst])
        t0 = time.perf_counter()
        once()
        _sync(device)
        first = time.perf_counter() - t0
        counts = torch.tensor(_budgeted(first, nbytes, iters, warmup, point_s),
                              dtype=torch.int64)
        if point_s is not None:  # the sender's counts, so both sides run the same calls
            if me == src:
                dist.send(counts, dst=peer)
            else:
                dist.recv(counts, src=peer)
        more, k = (int(x) for x in counts.tolist())
        if k == 0:
            one_way = first / 2  # the sender's first round trip was the measurement
        else:
            for _ in range(more):
                once()
            _sync(device)
            if fastest:
                trips = []
                for _ in range(k):
                    t0 = time.perf_counter()
                    once()
                    _sync(device)
                    trips.append(time.perf_counter() - t0)
                one_way = min(trips) / 2
            else:
                t0 = time.perf_counter()
                for _ in range(k):
                    once()
                _sync(device)
                one_way = (time.perf_counter() - t0) / k / 2
        if heartbeat is not None:
            heartbeat.left()
        if me == src:
            rows.append(_row(dim, [src, dst], "send_recv", nbytes, one_way, max(k, 1)))
    return rows


def build_groups(dims: ParallelDims) -> dict[str, dict[tuple[int, ...], Any]]:
    """Process groups of every TP and DP group of size > 1. Collective: every rank calls it,
    in this fixed order (dim, then group), as `dist.new_group` requires."""
    out: dict[str, dict[tuple[int, ...], Any]] = {}
    for dim in (Dim.TP, Dim.DP):
        for ranks in dims.groups(dim):
            if len(ranks) > 1:
                out.setdefault(dim.value, {})[tuple(ranks)] = dist.new_group(ranks)
    return out


def pp_pairs(dims: ParallelDims) -> list[tuple[int, int]]:
    """Neighbouring pipeline stages (stage s -> s+1) of every pipeline, in a global order."""
    return [(g[i], g[i + 1]) for g in dims.groups(Dim.PP) for i in range(len(g) - 1)]


def probe_layout(dims: ParallelDims, rank: int, *, sizes: Iterable[int] = DEFAULT_SIZES,
                 ops: Iterable[str] = DEFAULT_OPS, iters: int = 20, warmup: int = 3,
                 groups: dict[str, dict[tuple[int, ...], Any]] | None = None,
                 point_s: float | None = None, heartbeat: Heartbeat | None = None,
                 beat_step: int = -1) -> list[dict[str, Any]]:
    """Probe this rank's TP group, DP group and PP neighbour pairs; every rank calls it.

    `groups` reuses the trainer's process groups ({dim: {ranks: group}}); by default they are
    built here. All groups of one dimension run concurrently, as they do in training. Returns
    the rows this rank reports (first rank of a group, sender of a pair). `point_s` bounds
    each point's time after its first call (see `JOB_PROBE_POINT_S`); the heartbeat says
    `probe` at `beat_step` (-1: before training).
    """
    sizes, ops = list(sizes), list(ops)
    if dims.world_size != dist.get_world_size():
        raise ValueError(f"layout world size {dims.world_size} != process group world size "
                         f"{dist.get_world_size()}")
    groups = build_groups(dims) if groups is None else groups
    if heartbeat is not None:
        heartbeat.beat(beat_step, "probe")
    rows: list[dict[str, Any]] = []
    for dim in (Dim.TP, Dim.DP):
        mine = tuple(dims.group_of(rank, dim))
        if len(mine) > 1:
            rows += probe_group(groups[dim.value][mine], mine, dim=dim.value, sizes=sizes,
                                ops=ops, iters=iters, warmup=warmup, point_s=point_s,
                                heartbeat=heartbeat)
    for src, dst in pp_pairs(dims):
        if rank in (src, dst):
            rows += probe_pair(src, dst, sizes=sizes, iters=iters, warmup=warmup,
                               point_s=point_s, heartbeat=heartbeat)
    return rows


HOST_DIM = "host"
"""The rows' dim of the pairs between hosts (`service.monitor.links.HOST_DIM`)."""


def host_pairs(node_of_rank: Sequence[str]) -> list[tuple[int, int]]:
    """The pairs of ranks that measure the links between hosts (`node_of_rank[r]`: rank r's
    node): the lowest rank of each host to that of the next host, in a ring (two hosts: one
    pair). Each host's link is crossed by two pairs that share no other host, from three hosts
    on, so that the host common to the slow pairs can be named (`service.monitor.links`); a
    ring keeps the probe's time linear in the hosts."""
    leads: dict[str, int] = {}
    for rank, node in enumerate(node_of_rank):
        leads.setdefault(node, rank)
    first = sorted(leads.values())
    if len(first) < 3:
        return [(first[0], first[1])] if len(first) == 2 else []
    return [(first[i], first[(i + 1) % len(first)]) for i in range(len(first))]


def probe_hosts(node_of_rank: Sequence[str], rank: int, *, sizes: Iterable[int],
                point_s: float | None = None,
                heartbeat: Heartbeat | None = None) -> list[dict[str, Any]]:
    """send/recv between hosts over `host_pairs`, one pair at a time (each rank takes its
    pairs in their global order: the first pair not done always has both ranks at it); every
    rank calls it, and the sender of each pair returns its rows (dim `host`), each pair's
    fastest round trip (`probe_pair(fastest=True)`): the links are judged against each other
    (`service.monitor.links`), and a pair slowed by its processes' share of a busy host's
    cores, not by its link, must not read as a slow link."""
    sizes = list(sizes)
    rows: list[dict[str, Any]] = []
    for src, dst in host_pairs(node_of_rank):
        if rank in (src, dst):
            rows += probe_pair(src, dst, sizes=sizes, dim=HOST_DIM, point_s=point_s,
                               heartbeat=heartbeat, fastest=True)
    return rows


def node_ids(node_id: str) -> list[str]:
    """Every rank's node id, gathered over the default process group (collective)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, node_id)
    return [str(n) for n in out]
