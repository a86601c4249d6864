"""One CPU rank of a job in a process a script started itself (one per rank, on gloo), set up
as the trainer sets up its ranks (`workers.trainer.train.setup_rank`: the job's environment, the
process group, DeepSpeed; then this rank's row of the plan, its groups and DeepSpeed config).
Such a script reads its resident memory around the engine's construction with
`workers.monitor.proc_status`.

For the scripts that start ranks by hand and time or measure the construction:
`bench/_hf_rank.py` (`bench.models_hf`) and `tests/_construction_rank.py`
(tests/test_workers_construction.py). The worker group's ranks go through `workers.rank.actor`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from service.contract.spec import JobSpec
    from service.planner.shape import ModelShape
    from workers.modeling.tp import RankGroups
    from workers.runtime.programs import RankContext


@dataclass(frozen=True)
class ScriptRank:
    """What the trainer has before it builds the engine."""

    spec: JobSpec
    ctx: RankContext
    device: torch.device
    groups: RankGroups
    ds_config: dict[str, Any]
    shape: ModelShape


def start(spec_json: str, rank: int, world: int, port: int) -> ScriptRank:
    """Rank `rank` of `world` of the job `spec_json` (a `JobSpec` as JSON) on this host's CPU,
    its peers reached on 127.0.0.1:`port`; one torch thread (the ranks share the cores).
    DeepSpeed's accelerator is set to the CPU before torch and DeepSpeed are imported."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    torch.set_num_threads(1)
    from service.contract.spec import JobSpec
    from service.planner.shape import ModelShape
    from workers.modeling.tp import build_groups
    from workers.runtime.programs import RankContext
    from workers.trainer import train

    spec = JobSpec.model_validate_json(spec_json)
    ctx = RankContext(rank=rank, world_size=world, local_rank=rank,
                      master_addr="127.0.0.1", master_port=port, checkpoint_dir=None,
                      plan=train.planned_row(spec, rank))
    device = train.setup_rank(spec, ctx)
    groups = build_groups(spec.layout.dims, rank)
    return ScriptRank(spec=spec, ctx=ctx, device=device, groups=groups,
                      ds_config=train.deepspeed_config(spec, device),
                      shape=ModelShape.from_spec(spec.planned_model))


def stop() -> None:
    """After every rank's work: wait for the peers, then destroy the process groups."""
    from workers.trainer import train
    train.teardown_rank(wait_for_peers=True)


