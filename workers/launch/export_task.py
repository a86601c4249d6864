"""`trident export` on Ray: the export's folder written by a Ray task
(`service.control.export_run` runs `ray_export` on a thread of the controller's).

The task requests one CPU and the memory the export holds at most (`ExportWork.memory_bytes`:
one shard, twice one tensor, the interpreter), so Ray places it only where that much is free; it
prefers the node where the job's rank 0 last ran (soft affinity), which wrote the tag's
files, and runs elsewhere when that node is gone (the tag is then read from storage every
node shares, or the task refuses naming the missing tag). Its worker process ends with it
(`max_calls=1`): the memory its tensors took is given back to the node.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.files.export import ExportDone, ExportWork

log = logging.getLogger(__name__)
CPUS = 1.0
"""The CPUs the task requests: the conversion runs on one thread."""


@ray.remote(max_calls=1)
def _write(work: dict[str, Any]) -> dict[str, Any]:
    from workers.checkpoint.hf_export import write_export

    return write_export(ExportWork.from_json(work)).to_json()


def options(work: ExportWork) -> dict[str, Any]:
    """The task's Ray options: its CPUs, its memory, where it goes."""
    opts: dict[str, Any] = {"num_cpus": CPUS, "memory": work.memory_bytes()}
    if work.node_id:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(work.node_id, soft=True)
    return opts


def ray_export(work: ExportWork) -> ExportDone:
    """Run the export as a Ray task on the cluster this process is connected to and wait for
    it; refused at once when no live node has the memory it requests."""
    need = work.memory_bytes()
    largest = max((float(n.get("Resources", {}).get("memory", 0)) for n in ray.nodes()
                   if n.get("Alive")), default=0.0)
    if need > largest:
        return ExportDone(refused=f"the export needs {need} bytes of memory (one shard of"
                          f" {work.max_shard_bytes}, one tensor, the interpreter) and the"
                          f" largest node has {int(largest)}: ask for a smaller"
                          " --max-shard-size")
    ref = _write.options(**options(work)).remote(work.to_json())  # type: ignore[attr-defined]
    log.info("export %d of job %d: Ray task %s (memory %d bytes, preferring node %s) writes"
             " %s", work.export_id, work.job_id, ref.task_id().hex(), need,
             work.node_id or "-", work.destination)
    return ExportDone(**ray.get(ref))
