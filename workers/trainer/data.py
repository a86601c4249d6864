"""A job's data as its ranks read it: synthetic sequences, or the global sample order of its
corpora (`workers.trainer.sample_order`), behind one seam (`DataSource`).

Every source is a function of the global sample number: a step that has consumed samples c
so far and trains on a global batch of b reads samples [c, c + b), DP replica d the d-th
contiguous slice of that, cut into micro-batches (`micro_batches_at`). So the order does not
depend on TP, PP or DP, and the data position of a run is its consumed samples, stored in each
checkpoint and read back on resume: a run resumed with another `train.global_batch` (or
during `train.batch_ramp`) reads on from the next unread sample. The loader keeps the global
sample numbers it returned (`read`), which the step reports are made of. Evaluation reads the
same `data.eval_batches` global batches of the validation order every time.

Synthetic token data: a deterministic function of (seed, global sample index).

Sample i is a noisy arithmetic sequence modulo a quarter of the vocabulary: start and stride
drawn from the sample's own generator, and 10% of the tokens replaced by random ones (from the
same quarter). A model learns it in two phases, both visible within a few dozen steps: first that
only a quarter of the tokens occur (ln V -> ln V/4), then the stride (after two tokens the rest
is predictable). So the loss really falls, and since every sample
depends only on its index the data does not depend on the layout.

Called by `workers.trainer.train` (and by custom entrypoints, through `TrainContext.data`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.contract.spec import JobSpec
from service.files.order_cache import ServerData
from workers.modeling.vocab import IGNORE

NOISE = 0.1
EVAL_OFFSET = 1 << 40
"""Synthetic validation samples are numbered from here: never a training sample."""
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


Batch = tuple[Any, torch.Tensor]
"""(inputs, labels): inputs are tokens (batch, seq), or (tokens, documents) with
`data.document_mask`; labels are the next tokens, IGNORE where no loss is taken."""


def to_device(batches: Iterator[Batch], device: torch.device) -> Iterator[Batch]:
    """`batches` with every tensor moved to `device`."""
    for x, y in batches:
        x = tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)
        yield x, y.to(device)


@dataclass
class Progress:
    """What the samples consumed so far amount to."""

    samples: int
    tokens: int
    """Tokens trained on: samples * seq_len (the inputs of each window)."""
    epoch: float | None
    """Passes over the (first) training corpus; None for synthetic data."""
    drawn: dict[str, int] | None
    """Samples drawn from each training corpus (by path); None for synthetic data."""


@dataclass
class DataSource:
    """This rank's view of the job's data (synthetic; `TokenSource` reads corpora)."""

    seed: int
    seq_len: int
    vocab: int
    global_batch: int
    micro_batch: int
    dp: int
    dp_rank: int
    eval_every: int = 0
    eval_batches: int = 0
    read: list[int] = field(default_factory=list)
    """The global sample numbers this replica's loader returned for the last training batch
    (`micro_batches_at`), in order, as each micro-batch was read."""
    document_mask: bool = False
    """Inputs are (tokens, documents): `workers.modeling.model.Documents` (corpora only)."""
    eod_loss_mask: bool = False
    """Labels after a document's EOD token are IGNORE (corpora only)."""
    loss_mask: bool = False
    """Kind chat: labels are IGNORE where the corpus's loss mask says the token does not
    train, and the loss is the mean over the global batch's tokens that train."""

    def sample(self, j: int) -> np.ndarray | torch.Tensor:
        """The seq_len + 1 tokens of global training sample j."""
        return sample(self.seed, j, self.seq_len, self.vocab)

    def eval_sample(self, j: int) -> np.ndarray | torch.Tensor:
        """The seq_len + 1 tokens of validation sample j."""
        return sample(self.seed, EVAL_OFFSET + j, self.seq_len, self.vocab)

    def replica_samples(self, first: int, count: int | None = None) -> range:
        """The sample numbers this DP replica reads of the global batch of `count` samples
        (default `global_batch`) starting at `first`."""
        per = (self.global_batch if count is None else count) // self.dp
        return range(first + self.dp_rank * per, first + (self.dp_rank + 1) * per)

    def _batches(self, numbers: range, get: Callable[[int], np.ndarray | torch.Tensor],
                 seen: list[int] | None = None) -> Iterator[Batch]:
        for m in range(0, len(numbers), self.micro_batch):
            chunk = numbers[m:m + self.micro_batch]
            rows = torch.stack([torch.as_tensor(get(j), dtype=torch.int64) for j in chunk])
            if seen is not None:
                seen.extend(chunk)
            yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def _rows(self, numbers: range, order: Any, seen: list[int] | None = None
              ) -> Iterator[Batch]:
        """Micro-batches of `numbers` read straight into one int64 array each; with
        `document_mask` the inputs are (tokens, documents), with `eod_loss_mask` the labels
        of the predictions made at a document's last token (its EOD) are IGNORE."""
        for m in range(0, len(numbers), self.micro_batch):
            chunk = numbers[m:m + self.micro_batch]
            rows = np.empty((len(chunk), self.seq_len + 1), dtype=np.int64)
            for i, j in enumerate(chunk):
                order.tokens(j, rows[i])
            if seen is not None:
                seen.extend(chunk)
            t = torch.from_numpy(rows)
            x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
            if self.loss_mask:  # kind chat: no loss where the predicted token does not train
                mask = np.empty_like(rows)
                for i, j in enumerate(chunk):
                    order.loss_mask(j, mask[i])
                y = y.masked_fill(torch.from_numpy(mask[:, 1:] == 0), IGNORE)
            if not (self.document_mask or self.eod_loss_mask):
                yield x, y
                continue
            docs = np.empty_like(rows)
            for i, j in enumerate(chunk):
                order.documents(j, docs[i])
            d = torch.from_numpy(docs)
            if self.eod_loss_mask:  # input i ends its document: the next token is another's
                y = y.masked_fill(d[:, 1:] != d[:, :-1], IGNORE)
            yield ((x, d[:, :-1].contiguous()) if self.document_mask else x), y

    def micro_batches_at(self, consumed: int, count: int) -> Iterator[Batch]:
        """This DP replica's micro-batches of the global batch of `count` samples that follows
        the `consumed` samples read so far; the sample numbers returned go into `read`."""
        self.read = []
        return self._batches(self.replica_samples(consumed, count), self.sample, self.read)

    def micro_batches(self, step: int) -> Iterator[Batch]:
        """This DP replica's micro-batches of optimizer step `step` (0-based) of a run that
        kept `global_batch` from the start."""
        return self.micro_batches_at(step * self.global_batch, self.global_batch)

    def cover(self, samples: int) -> None:
        """Collective (every rank, the same `samples`): make the first `samples` training
        samples readable (synthetic data always are)."""

    def eval_due(self, step: int, last: int) -> bool:
        """Whether the validation loss is measured after step `step` (1-based) of `last`."""
        return bool(self.eval_every) and (step % self.eval_every == 0 or step == last)

    def eval_micro_batches(self, batch: int) -> Iterator[Batch]:
        """This DP replica's micro-batches of validation global batch `batch`."""
        return self._batches(self.replica_samples(batch * self.global_batch),
                             self.eval_sample)

    def progress(self, samples: int) -> Progress:
        return Progress(samples=samples, tokens=samples * self.seq_len, epoch=None,
                        drawn=None)


@dataclass
class TokenSource(DataSource):
    """The corpora's global sample order (`workers.trainer.sample_order`), memory-mapped."""

    train_order: object = None
    valid_order: object = None
    paths: list[str] = field(default_factory=list)
    reopen: Callable[[int], object] | None = None
    """Collective: the training order of at least that many samples (built by rank 0)."""
    _drawn_at: tuple[int, np.ndarray] | None = None

    def sample(self, j: int) -> np.ndarray:
        return self.train_order.tokens(j)  # type: ignore[attr-defined]

    def eval_sample(self, j: int) -> np.ndarray:
        return self.valid_order.tokens(j)  # type: ignore[attr-defined]

    def micro_batches_at(self, consumed: int, count: int) -> Iterator[Batch]:
        self.read = []
        return self._rows(self.replica_samples(consumed, count), self.train_order, self.read)

    def cover(self, samples: int) -> None:
        """The order is built for `train.steps * train.global_batch` samples; a run resumed
        from a larger batch than its own needs more. The order of more samples begins with
        the order of fewer (`workers.trainer.sample_order`): the same samples, more of them."""
        if samples > len(self.train_order) and self.reopen is not None:  # type: ignore[arg-type]
            self.train_order = self.reopen(samples)

    def eval_micro_batches(self, batch: int) -> Iterator[Batch]:
        return self._rows(self.replica_samples(batch * self.global_batch), self.valid_order)

    def progress(self, samples: int) -> Progress:
        order = self.train_order
        # Counted once from the start, then step by step: memory and time stay per step.
        if self._drawn_at is None or self._drawn_at[0] > samples:
            self._drawn_at = (0, np.zeros(len(self.paths), dtype=np.int64))
        done, counts = self._drawn_at
        if samples > done:
            which = np.asarray(order.which[done:samples])  # type: ignore[attr-defined]
            counts = counts + np.bincount(which, minlength=len(self.paths))
            self._drawn_at = (samples, counts)
        epoch = float(counts[0]) / order.per_epoch[0]  # type: ignore[attr-defined]
        return Progress(samples=samples, tokens=samples * self.seq_len, epoch=epoch,
                        drawn={p: int(c) for p, c in zip(self.paths, counts, strict=True)})


def _parts(spec: JobSpec) -> tuple[list, list]:
    from workers.trainer.sample_order import Part

    d = spec.data
    train = [Part(r.path, r.fingerprint, r.weight, d.valid_fraction, "train") for r in d.train]
    if d.valid:
        valid = [Part(r.path, r.fingerprint, r.weight, 0.0, "valid") for r in d.valid]
    elif d.valid_fraction:
        valid = [Part(r.path, r.fingerprint, r.weight, d.valid_fraction, "valid")
                 for r in d.train]
    else:
        valid = []
    return train, valid


def open_source(spec: JobSpec, dp_rank: int, rank: int,
                share: Callable[[str | None], str | None] = lambda e: e,
                barrier: Callable[[], None] = lambda: None,
                server: ServerData | None = None, user: str = "") -> DataSource:
    """This rank's `DataSource` for `spec`. For corpora, rank 0 resolves them against the
    server's data roots again, checks that none changed since submission (their fingerprints:
    a file replaced by another of the same size and time included) and builds the sample
    orders into the server's cache (`server`; None: the one this environment's settings name)
    for `user`'s job (once: they are cached); `share` broadcasts its error (None: none) to
    every rank, which all raise it, and `barrier` waits for the build."""
    t, d, m = spec.train, spec.data, spec.planned_model
    layout = spec.layout
    common = dict(seed=t.seed, seq_len=m.seq_len, vocab=m.vocab, global_batch=t.global_batch,
                  micro_batch=t.micro_batch, dp=layout.dp, dp_rank=dp_rank,
                  eval_every=d.eval_every, eval_batches=d.eval_batches)
    if d.kind == "synthetic":
        return DataSource(**common)  # type: ignore[arg-type]
    from workers.trainer import sample_order
    server = server or ServerData.from_settings()
    train, valid = _parts(spec)
    samples, eval_samples = t.steps * t.global_batch, d.eval_batches * t.global_batch
    error: str | None = None
    built: list[Any] = []
    if rank == 0:
        error, built = _build(spec, server, user, train, valid, samples, eval_samples)
    error = share(error)
    if error is not None:
        raise DataChanged(error)
    barrier()
    if built:
        train_order = built[0]
        valid_order = built[1] if valid else None
    else:  # rank 0's, read; built again on a host that does not share the data directory
        cache = server.orders
        train_order = sample_order.build(cache, user, train, t.seed, m.seq_len, samples)
        valid_order = sample_order.build(cache, user, valid, t.seed + 1, m.seq_len,
                                         eval_samples) if valid else None

    def reopen(more: int) -> object:
        problem: str | None = None
        order = None
        if rank == 0:
            try:
                order = sample_order.build(server.orders, user, train, t.seed, m.seq_len, more)
            except Exception as exc:  # noqa: BLE001 - every rank raises it below
                problem = f"data: {exc}"
        problem = share(problem)
        if problem is not None:
            raise DataChanged(problem)
        barrier()
        return order or sample_order.build(server.orders, user, train, t.seed, m.seq_len, more)

    return TokenSource(**common,  # type: ignore[arg-type]
                       document_mask=d.document_mask, eod_loss_mask=d.eod_loss_mask,
                       loss_mask=d.kind == "chat",
                       train_order=train_order, valid_order=valid_order,
                       paths=[p.prefix for p in train_order.parts], reopen=reopen)


class DataChanged(RuntimeError):
    """A corpus changed after submission, or its sample order could not be built."""


def _build(spec: JobSpec, server: ServerData, user: str, train: list, valid: list,
           samples: int, eval_samples: int) -> tuple[str | None, list]:
    """Rank 0: the error that stops every rank (None: none), and the orders it built."""
    from service.files import corpus
    from service.files.data_check import changed_corpus
    from service.files.order_cache import CacheRefused
    from service.submission.confine import data_refusal
    from workers.trainer import sample_order
    roots = [Path(r) for r in server.data_roots]
    for ref in [*spec.data.train, *spec.data.valid]:
        # As submitted corpora were checked (a spec run without the API has no fingerprint):
        # a path may lead elsewhere now, through a symlink put in since.
        if ref.fingerprint is not None and (
                why := data_refusal(ref.path, roots, spec.data.kind == "chat")):
            return f"data: {why}", []
    if why := changed_corpus(spec):
        return why, []
    try:
        for ref in [*spec.data.train, *spec.data.valid]:
            if ref.fingerprint is None:  # not submitted through the API (torchrun, tests)
                corpus.check(ref.path, spec.planned_model.vocab)
        t, seq_len = spec.train, spec.planned_model.seq_len
        built = [sample_order.build(server.orders, user, train, t.seed, seq_len, samples)]
        if valid:
            built.append(sample_order.build(server.orders, user, valid, t.seed + 1, seq_len,
                                            eval_samples))
    except (corpus.CorpusError, CacheRefused, OSError) as exc:
        return f"data: {exc}", []
    return None, built
