"""A job's bandwidth probe again during training, every `monitor.probe_every_s`, at a step
boundary: the links between hosts and the DP/TP groups' all-reduce, to find a link that
became slow after the probe before training (`service.monitor.links` names its host).

Called by the rank actor (`workers.rank.actor`) on every rank of the built-in trainer, after
each step's report, on the trainer's own process group: `ProbeRounds.at_boundary(step)`. The
ranks must agree on when: rank 0's clock decides, and one tiny all-reduce of its decision at
every boundary tells the others (the trainer's stop check is one such collective a step
already; this is a second, of 4 bytes). A round probes `probe_layout`'s groups on all-reduce
only and `probe_hosts`' pairs, at the job's probe sizes (`monitor.probe_max_bytes`), with
the probe's budget per point (`JOB_PROBE_POINT_S`); its collectives happen between the
step's report and the next step's start, where the collective timer drops what it counted
(`CommTimer.step_started`), so no step's communication includes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from service.contract.parallel import ParallelDims
from workers.monitor.comm_probe import (
    JOB_PROBE_POINT_S,
    _device,
    build_groups,
    job_sizes,
    node_ids,
    probe_hosts,
    probe_layout,
)
from workers.runtime.heartbeat import Heartbeat


class ProbeRounds:
    """One rank's probes during training; the probe before training is round 0."""

    def __init__(self, dims: ParallelDims, rank: int, *, every_s: float, max_bytes: int,
                 node_id: str, put: Callable[[dict[str, Any]], None],
                 heartbeat: Heartbeat | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dims, self.rank, self.every_s = dims, rank, every_s
        self.sizes = job_sizes(max_bytes)
        self.node_id, self.put, self.heartbeat, self.clock = node_id, put, heartbeat, clock
        self.last = clock()
        self.round = 0
        self._groups: dict[str, dict[tuple[int, ...], Any]] | None = None
        self._nodes: list[str] | None = None

    def due(self, stopping: bool) -> bool:
        """Whether every rank probes now: rank 0's decision (its interval passed, and it is
        not stopping), all-reduced. Every rank calls it at every step boundary."""
        mine = self.rank == 0 and not stopping and self.clock() - self.last >= self.every_s
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=_device(None))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def at_boundary(self, step: int, stopping: bool = False) -> bool:
        """After step `step`'s report: probe if due (then report the round's rows, a
        `ProbeReport` of round n); whether it probed."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or not self.due(stopping):
            return False
        self.round += 1
        if self._nodes is None:  # collective, as the groups are: every rank at once
            self._nodes = node_ids(self.node_id)
            self._groups = build_groups(self.dims)
        rows = probe_layout(self.dims, self.rank, sizes=self.sizes, ops=("all_reduce",),
                            groups=self._groups, point_s=JOB_PROBE_POINT_S,
                            heartbeat=self.heartbeat, beat_step=step)
        rows += probe_hosts(self._nodes, self.rank, sizes=self.sizes,
                            point_s=JOB_PROBE_POINT_S, heartbeat=self.heartbeat)
        dist.barrier()
        self.last = self.clock()
        self.put({"kind": "probe", "rank": self.rank, "round": self.round, "step": step,
                  "rows": rows})
        return True
