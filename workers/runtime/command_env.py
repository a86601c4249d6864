"""The environment of a command job's process (`workers.rank.command`): torchrun's variables,
Trident's own, and what the rank actor's environment holds already (the job's `env` and
`secrets` under the spec's rules, the thread and device defaults, `CUDA_VISIBLE_DEVICES` as
Ray placed the rank; `workers.launch.group.rank_env`).

torchrun's variables are those its elastic agent gives each worker
(`torch.distributed.elastic.agent.server.local_elastic_agent`): `RANK`, `WORLD_SIZE`,
`LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK` (the node's index), `GROUP_WORLD_SIZE` (the
nodes), `ROLE_NAME`, `ROLE_RANK`, `ROLE_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
`TORCHELASTIC_RESTART_COUNT` (the job's attempts before this one) and `TORCHELASTIC_RUN_ID`
(the job's). Kept apart from the runner so that it is checked without a process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.contract.spec import JobSpec

RESERVED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
            "TRIDENT_JOB_ID", "TRIDENT_ATTEMPT", "TRIDENT_CHECKPOINT_DIR", "TRIDENT_RESUME_STEP",
            "TRIDENT_REPORT")
"""The variables Trident sets for a command: a job's `env` of the same name is replaced."""


@dataclass(frozen=True)
class NodePlace:
    """Where a rank's node sits among the group's, as torchrun numbers nodes: in the order the
    ranks' nodes first appear, rank 0's first."""

    local_world_size: int
    """Ranks of the job on this rank's node."""
    group_rank: int
    """This node's index."""
    group_world_size: int
    """Nodes the job's ranks are on."""

    @classmethod
    def of(cls, rank: int, node_ids: list[str]) -> NodePlace:
        """Rank `rank`'s, where `node_ids[r]` is the node of rank r."""
        nodes = list(dict.fromkeys(node_ids))
        here = node_ids[rank]
        return cls(local_world_size=node_ids.count(here), group_rank=nodes.index(here),
                   group_world_size=len(nodes))

    def to_json(self) -> dict[str, Any]:
        return {"local_world_size": self.local_world_size, "group_rank": self.group_rank,
                "group_world_size": self.group_world_size}


def command_env(base: Mapping[str, str], spec: JobSpec, *, rank: int, world_size: int,
                local_rank: int, node: NodePlace, master_addr: str, master_port: int,
                job_id: int | None, attempt: int, checkpoint_dir: str | None,
                resume_step: int, report_path: str,
                gpu_ids: list[str] | None = None) -> dict[str, str]:
    """The command's environment: `base` (the rank actor's, which holds the job's `env` and
    `secrets`) with torchrun's and Trident's variables over it. `resume_step`: the newest
    complete checkpoint tag of the job's folder (0: none, and no `TRIDENT_RESUME_STEP`);
    `gpu_ids`: the GPUs Ray gave the rank (None or empty: `base`'s `CUDA_VISIBLE_DEVICES`)."""
    env = {k: v for k, v in base.items() if k not in RESERVED}
    env.update({
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(node.local_world_size),
        "GROUP_RANK": str(node.group_rank), "GROUP_WORLD_SIZE": str(node.group_world_size),
        "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_RESTART_COUNT": str(max(0, attempt - 1)),
        "TORCHELASTIC_RUN_ID": f"trident-job{job_id}" if job_id is not None else "trident",
        "TRIDENT_ATTEMPT": str(attempt),
        "TRIDENT_REPORT": report_path,
        # The script's prints reach the rank log (and its progress) as they happen, not when
        # a pipe's buffer fills.
        "PYTHONUNBUFFERED": "1",
    })
    if job_id is not None:
        env["TRIDENT_JOB_ID"] = str(job_id)
    if checkpoint_dir:
        env["TRIDENT_CHECKPOINT_DIR"] = checkpoint_dir
    if resume_step > 0:
        env["TRIDENT_RESUME_STEP"] = str(resume_step)
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    return env


def report_path(log_dir: str | None, rank: int, attempt: int) -> str:
    """Where rank `rank` of the attempt writes its report lines: beside its rank log (in the
    attempt's log folder), else in the temporary folder."""
    if log_dir:
        return os.path.join(log_dir, f"rank-{rank}.report.jsonl")
    import tempfile

    return os.path.join(tempfile.gettempdir(),
                        f"trident-{os.getpid()}-a{attempt}-rank-{rank}.report.jsonl")
