"""Spec parts for the software stack and the pipeline partition, kept out of spec.py.

`train.stack` names the training software whose speed and memory the planner models
(`service.planner.stacks` holds each stack's constants and their sources); only `trident`
runs on Trident's own workers, the others are for planning runs made elsewhere.
`parallel.partition` says how pipeline stages split layers that need not divide evenly.
"""

from __future__ import annotations

from typing import Literal

Stack = Literal["trident", "megatron-lm", "megatron-deepspeed", "deepspeed", "fsdp"]
Partition = Literal["uniform", "parameters"]


def layer_split_errors(layers: int, pp: int, virtual_stages: int,
                       partition: str) -> list[tuple[str, str]]:
    """(field, message) for a pipeline split that cannot be made: fewer layers than model
    chunks, or a `parameters` balance too costly to compute (service.parallel)."""
    from service.parallel import PARTITION_WORK_LIMIT, partition_work

    chunks = pp * virtual_stages
    if layers < chunks:
        return [("parallel.pp", f"layers({layers}) is fewer than pp({pp}) * virtual_stages"
                 f"({virtual_stages}) = {chunks}: every model chunk needs a layer")]
    if partition == "parameters" and partition_work(layers + 2, chunks) > PARTITION_WORK_LIMIT:
        return [("parallel.partition", f"balancing {layers} layers over {chunks} chunks by"
                 " parameters is too costly to compute; use partition 'uniform'")]
    return []

