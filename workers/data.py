"""Synthetic token data: a deterministic function of (seed, global sample index).

Sample i is a noisy arithmetic sequence modulo a quarter of the vocabulary: start and stride
drawn from the sample's own generator, and 10% of the tokens replaced by random ones (from the
same quarter). A model learns it in two phases, both visible within a few dozen steps: first that
only a quarter of the tokens occur (ln V -> ln V/4), then the stride (after two tokens the rest
is predictable). So the loss really falls, and since every sample
depends only on its index the data does not depend on the layout: step t uses samples
[t * global_batch, (t + 1) * global_batch), DP replica d takes the d-th contiguous slice of that
and cuts it into micro-batches. The data position of a run is therefore just its step.

Called by `workers.train` (and by custom entrypoints that want the same data).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

NOISE = 0.1
MAX_STRIDE = 7


def sample(seed: int, index: int, seq_len: int, vocab: int) -> torch.Tensor:
    """seq_len + 1 tokens of sample `index` (int64)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + index) & (2**63 - 1))
    modulus = max(2, vocab // 4)
    start = int(torch.randint(modulus, (1,), generator=gen))
    stride = int(torch.randint(1, MAX_STRIDE + 1, (1,), generator=gen))
    tokens = (start + stride * torch.arange(seq_len + 1)) % modulus
    noisy = torch.rand(seq_len + 1, generator=gen) < NOISE
    random = torch.randint(modulus, (seq_len + 1,), generator=gen)
    return torch.where(noisy, random, tokens)


def batch(seed: int, first: int, count: int, seq_len: int, vocab: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token labels, each (count, seq_len), of samples first .. first+count-1."""
    rows = torch.stack([sample(seed, first + i, seq_len, vocab) for i in range(count)])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def micro_batches(*, seed: int, step: int, dp_rank: int, dp: int, global_batch: int,
                  micro_batch: int, seq_len: int, vocab: int
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This DP replica's micro-batches of optimizer step `step` (0-based)."""
    per_replica = global_batch // dp
    first = step * global_batch + dp_rank * per_replica
    for m in range(per_replica // micro_batch):
        yield batch(seed, first + m * micro_batch, micro_batch, seq_len, vocab)
