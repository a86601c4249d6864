"""The data side of a rank's loop beside the trainer (`workers.trainer.train`): opening the job's
data source on every rank (rank 0 builds the sample order, the others wait), and measuring the
validation loss under every layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from service.contract.spec import JobSpec
from service.files.order_cache import ServerData
from workers.modeling.tp import RankGroups, dp_all_reduce
from workers.modeling.vocab import IGNORE, LossFn
from workers.trainer import data


def open_data(spec: JobSpec, rank: int, groups: RankGroups, device: torch.device,
              server: ServerData | None = None, user: str = "") -> data.DataSource:
    """This rank's data source (`workers.trainer.data`): for corpora, rank 0 builds the sample order
    once (into `server`'s cache, for `user`'s job) while the others wait, and an error there
    (a corpus changed since submission, the cache's bound) is raised on every rank."""
    def share(error: str | None) -> str | None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return error
        box = [error]
        dist.broadcast_object_list(box, src=0, device=device)
        return box[0]

    def barrier() -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    return data.open_source(spec, groups.dp_rank, rank, share, barrier, server, user)


def evaluate(engine, source: data.DataSource, pp: int, groups: RankGroups,
             device: torch.device, loss_fn: LossFn) -> float:
    """Collective: the mean validation loss over `source.eval_batches` global batches (the
    same on every rank): each through the pipeline's forward-only schedule, or without a
    pipeline this replica's micro-batches averaged (`loss_fn`: the vocabulary-parallel loss of
    `workers.modeling.model.loss_for`), then averaged over the DP replicas."""
    losses = []
    for b in range(source.eval_batches):
        batches = _to(source.eval_micro_batches(b), device)
        if pp > 1:
            losses.append(float(engine.eval_batch(data_iter=batches)))
            continue
        if getattr(source, "loss_mask", False):  # kind chat: the global-token mean, as training
            losses.append(_token_mean(engine, batches, source.dp, groups, loss_fn))
            continue
        total, count = torch.zeros((), dtype=torch.float32), 0
        with torch.no_grad():
            for x, y in batches:
                total += loss_fn(engine(x), y).float().cpu()
                count += 1
        total /= count
        if source.dp > 1:
            on_device = total.to(engine.device)
            dp_all_reduce(on_device, groups.dp)
            total = on_device.cpu() / source.dp
        losses.append(float(total))
    return sum(losses) / len(losses)


def _token_mean(engine, batches, dp: int, groups: RankGroups, loss_fn: LossFn) -> float:
    """The cross entropy summed over the labels that train in one global batch (every DP
    replica's micro-batches) over their count (0 when none trains)."""
    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in batches:
            out = engine(x)  # every replica runs each forward (ZeRO-3 gathers in it)
            kept = int((y != IGNORE).sum())
            if kept:  # a micro-batch with no label that trains adds nothing
                sums[0] += float(loss_fn(out, y)) * kept
                sums[1] += kept
    if dp > 1:
        on_device = sums.to(engine.device)
        dp_all_reduce(on_device, groups.dp)
        sums = on_device.cpu()
    return float(sums[0] / sums[1]) if sums[1] else 0.0


def _to(batches, device: torch.device):
    return data.to_device(batches, device)