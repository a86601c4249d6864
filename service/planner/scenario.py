"""One evaluated case: model shape, layout, batch, precision, cluster and profile together.

`Scenario` is the single argument of memory.py and timing.py, built by `evaluate`
(service/planner/plan.py) from a `JobSpec`. `ZeroConfig` carries DeepSpeed's buffer settings
with DeepSpeed's defaults, so that predicted bytes match what a DeepSpeed engine allocates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.contract.hardware import HardwareProfile, StackCalibration
from service.contract.parallel import ParallelDims
from service.contract.spec import ParallelSpec
from service.planner.shape import ModelShape
from service.planner.software_stacks import Loss, Stack, get_stack, profile_efficiency


@dataclass(frozen=True)
class ZeroConfig:
    """DeepSpeed ZeRO buffer settings (names as in DeepSpeed's `zero_optimization`)."""

    reduce_bucket_size: float = 5e8
    """Elements of one gradient-reduction bucket (allocated whole when contiguous)."""
    allgather_bucket_size: float = 5e8
    """Elements per parameter all-gather after the step (ZeRO-1/2); views, no extra bytes."""
    overlap_comm: bool | None = None
    """Double-buffer the reduction; None = DeepSpeed's default (off for 1/2, on for 3)."""
    contiguous_gradients: bool = True
    """Copy gradients into the reduction bucket (allocates it)."""
    stage3_prefetch_bucket_size: float = 5e7
    """ZeRO-3: elements of parameters fetched ahead of use."""
    stage3_max_live_parameters: float = 1e9
    """ZeRO-3: most gathered elements kept at once."""
    stage3_param_persistence_threshold: float = 1e5
    """ZeRO-3: tensors smaller than this many elements stay whole on every rank."""

    def overlap(self, zero: int) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else zero == 3


@dataclass(frozen=True)
class Scenario:
    shape: ModelShape
    layout: ParallelSpec
    micro_batch: int
    global_batch: int
    precision: str
    """`fp32`, `bf16` or `fp16`."""
    profile: HardwareProfile
    gpus_per_node: int
    nodes: int
    zero_cfg: ZeroConfig = field(default_factory=ZeroConfig)
    stack: str = "trident"
    """`train.stack`: whose kernels, buffers and optimizer layout
    (`service.planner.software_stacks`)."""
    constants: Stack | None = None
    """The stack's constants; None = `get_stack(stack)` (priors with the fitted values)."""
    gpu_efficiency: float | None = None
    """Fitted factor on the profile's GEMM rate; None = the fitted file's (1 when absent)."""
    flash_attention: bool | None = None
    """Override of the stack's flash attention (a published run made without it)."""
    loss: Loss | None = None
    """Override of the stack's loss kernel (stacks.loss_bytes_per_logit), for a published run
    whose framework computes its loss otherwise."""
    document_mask: bool = False
    """`data.document_mask`: each micro-batch's attention mask is built per sample
    (`service.planner.memory.attention_mask_bytes`)."""
    param_groups: int = 2
    """The optimizer's parameter groups: decayed and not (`workers.trainer.recipe`); one when
    everything decays alike (`train.weight_decay` 0, or `weight_decay_all`)."""
    async_save: bool = False
    """`checkpoint.async` with saves due (`every_steps` > 0): while a save is in flight each
    rank holds a host copy of what it saves (`MemoryBreakdown.checkpoint_copy`)."""

    @property
    def stack_constants(self) -> Stack:
        return self.constants or get_stack(self.stack)

    @property
    def flash(self) -> bool:
        if self.flash_attention is not None:
            return self.flash_attention
        return self.stack_constants.flash_attention

    @property
    def loss_kind(self) -> Loss:
        return self.loss or self.stack_constants.loss

    @property
    def recompute(self) -> str:
        """The layout's recompute as this stack runs it: `none`, `selective` (attention
        core), `op` (torchtitan's op-level policy, the `fsdp` stack's selective), `full`."""
        r = self.layout.recompute
        return "op" if r == "selective" and self.stack_constants.selective == "op" else r

    @property
    def calibration(self) -> StackCalibration | None:
        """The profile's calibration of this scenario's stack, when it applies: measured on
        this cluster at this precision's peak, and neither factor overridden (a published
        run's prediction)."""
        cal = self.profile.calibration
        if cal is None or cal.stack != self.stack or not cal.covers(self.precision) \
                or self.constants is not None or self.gpu_efficiency is not None:
            return None
        return cal

    @property
    def efficiency(self) -> float:
        """Stack x GPU factor on the GEMM rate: measured by this cluster's calibration jobs,
        else fitted to published runs."""
        if (cal := self.calibration) is not None:
            return cal.efficiency
        g = self.gpu_efficiency if self.gpu_efficiency is not None else \
            profile_efficiency(self.profile.name)
        return self.stack_constants.efficiency * g

    @property
    def stage_ranges(self) -> list[list[tuple[int, int]]]:
        """Each pipeline rank's block ranges (uneven when the layers do not divide)."""
        lay = self.layout
        return self.shape.stages(lay.pp, lay.virtual_stages, lay.partition)

    @property
    def stage_blocks(self) -> tuple[int, ...]:
        """Blocks on each pipeline rank, all its chunks together."""
        lay = self.layout
        return self.shape.stage_blocks(lay.pp, lay.virtual_stages, lay.partition)

    @property
    def dims(self) -> ParallelDims:
        return self.layout.dims

    @property
    def micro_batches(self) -> int:
        """m: micro-batches per step per pipeline."""
        return max(1, self.global_batch // (self.micro_batch * self.layout.dp))

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation / weight element in the training precision."""
        return 4 if self.precision == "fp32" else 2

    def peak_flops(self) -> float:
        return self.profile.peak_flops(self.precision)
