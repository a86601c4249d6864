"""Pipeline parallelism through DeepSpeed's pipeline engine.

`build_pipeline` wraps the model's flat layer list [Embedding, Block 0..L-1, Head] in a
`PipelineModule` over `PipeModelDataParallelTopology(num_pp, num_mp=tp, num_dp)`, whose rank
order (pipe, data, model; model fastest) is exactly `service.contract.parallel.ParallelDims`. The
stage
boundaries are the stored plan's, as the rank's row carries them (`RankPlan.stages`: uniform, or
by parameters as DeepSpeed's `partition_method='parameters'` balances them; the layers need not
divide by pp), with the embedding on the first stage and the head on the last. DeepSpeed runs
its 1F1B schedule (`TrainSchedule`) over global_batch / (micro_batch * dp) micro-batches per
step.

Interleaved stages (`virtual_stages` > 1) are not this module's: DeepSpeed's pipeline engine
has no interleaved schedule, so `workers.trainer.interleaved` runs them on
torch.distributed.pipelining.

Called by `workers.trainer.train`.
"""

from __future__ import annotations

from workers.runtime.deepspeed_import import deepspeed  # noqa: F401  (first: DeepSpeed without MLflow)

# isort: split
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from service.contract.parallel import ParallelDims
from service.planner.shape import ModelShape
from workers.modeling.model import Block, Embedding, Head, Recompute, check_buildable, loss_for
from workers.modeling.tp import RankGroups


def layer_parts(stages: list[list[tuple[int, int]]], layers: int) -> list[int]:
    """DeepSpeed's `parts` (layer-list boundaries per stage) from the plan's stage ranges
    (`RankPlan.stages`, even or not).

    The list holds the embedding at index 0, block i at index i + 1, the head at L + 1.
    """
    parts = [0] + [rng[0][1] + 1 for rng in stages]
    parts[-1] = layers + 2
    return parts


class _PlannedPipe(PipelineModule):
    """A PipelineModule whose stage boundaries are the plan's, not a balancing heuristic."""

    def __init__(self, *args, planned_parts: list[int], **kwargs) -> None:
        self._planned_parts = planned_parts
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        self.parts = list(self._planned_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def build_pipeline(shape: ModelShape, seed: int, dims: ParallelDims, groups: RankGroups,
                   recompute: Recompute, stages: list[list[tuple[int, int]]],
                   sequence_parallel: bool = False) -> PipelineModule:
    """This rank's stage of the pipeline whose stages hold `stages` (every stage's block
    ranges, from the rank's row of the plan)."""
    check_buildable(shape)
    sp = sequence_parallel
    if shape.tied:
        # The head projects with the token embedding: DeepSpeed builds a copy of the matrix on
        # the last stage, broadcasts the first stage's into it and sums their gradients.
        specs: list[LayerSpec] = [TiedLayerSpec("tok", Embedding, shape, seed, groups, sp,
                                                tied_weight_attr="tok")]
    else:
        specs = [LayerSpec(Embedding, shape, seed, groups, sp)]
    specs += [LayerSpec(Block, i, shape, seed, groups, recompute, None, sp)
              for i in range(shape.layers)]
    specs.append(TiedLayerSpec("tok", Head, shape, seed, groups, sp, tied_weight_attr="tok")
                 if shape.tied else LayerSpec(Head, shape, seed, groups, sp))
    topo = PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)
    return _PlannedPipe(layers=specs, topology=topo, loss_fn=loss_for(shape, groups),
                        planned_parts=layer_parts(stages, shape.layers),
                        activation_checkpoint_interval=0)
