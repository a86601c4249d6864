"""The global sample order of a job's corpora: which tokens global sample `i` is, for every i,
the same on every rank and under every TP x PP x DP layout.

It follows Megatron's `GPTDataset` and `BlendedDataset` (megatron/core/datasets), and uses
their compiled blending helper (`helpers_cpp`, shipped built in the megatron-core wheel,
loaded from its file so that `megatron.core`'s GPU model stack is not imported):

- per corpus, its documents (Megatron's sequences; the training or the held-out ones) are
  shuffled per epoch from the seed (one permutation per epoch), the epochs concatenated and
  cut into windows of `seq_len + 1` tokens that cross document boundaries (Megatron's
  `build_sample_idx`: window i starts at token `i * seq_len` of the stream, sharing one token,
  last label and first input, with window i - 1), then the windows are shuffled, an epoch's
  worth of windows (`(tokens - 1) // seq_len`) at a time, so that sample k of a corpus depends
  on the seed, the corpus and seq_len alone, never on how many samples a job takes;
- a blend of corpora draws global sample j from the corpus furthest below its share of the
  j samples drawn so far (`build_blending_indices`), taking that corpus's next window. The
  same corpus listed twice in a blend is one corpus of the summed weight (indexed once).

One process builds the index (`build`) for exactly the samples the job needs: per global
sample, its corpus, its window, and the sequences it spans with the offset into the first
(about 30 bytes a sample, whatever the corpus's size). It is kept in the sample-order cache
under the server's data directory (`service.files.order_cache`: shared by every job with the same
inputs, bounded per user and in all), and memory-mapped by every rank (`open_order`): a rank's
memory does not grow with the corpus.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.machinery
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from service.files import corpus
from service.files.data_check import fingerprint, held_out, opened_changed
from service.files.order_cache import OrderCache

FORMAT = 2
"""Bumped when the index files change meaning: a new hash, a new entry."""
ARRAYS = ("which", "window", "offset", "ptr", "seqs")
"""An order's arrays, one `.npy` each: per global sample its corpus (int16), that corpus's
window (int64), the offset of its first token in its first sequence (int32) and where its
sequences start in `seqs` (int64, one more than the samples); `seqs`: the sequence numbers
each sample spans, back to back."""


@cache
def helpers() -> Any:
    """megatron-core's compiled dataset helpers (`megatron.core.datasets.helpers_cpp`), loaded
    from the wheel's file without importing `megatron.core`."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("megatron-core is not installed")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "core", "datasets")
    found = sorted(glob.glob(os.path.join(folder, "helpers_cpp*.so")))
    if not found:
        raise ImportError(f"megatron-core's compiled helpers are not in {folder}")
    name = "megatron.core.datasets.helpers_cpp"  # its PyInit_ name is the last part
    loader = importlib.machinery.ExtensionFileLoader(name, found[0])
    module_spec = importlib.util.spec_from_file_location(name, found[0], loader=loader)
    assert module_spec is not None
    module = importlib.util.module_from_spec(module_spec)
    loader.exec_module(module)
    return module


def blend(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's blend of `size` samples: for each, the corpus (int16) and that corpus's
    sample number (int64). Every prefix is the blend of that many samples."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    which = np.zeros(size, dtype=np.int16)
    number = np.zeros(size, dtype=np.int64)
    if size:
        helpers().build_blending_indices(which, number, w, len(w), size, False)
    return which, number


@dataclass(frozen=True)
class Part:
    """One corpus of an order, and which of its documents it uses."""

    prefix: str
    fingerprint: str | None
    weight: float = 1.0
    held_out: float = 0.0
    """The fraction of its (last) documents held out of training (`data.valid_fraction`)."""
    side: str = "train"
    """`train`: the documents not held out; `valid`: the held-out ones (or all of a valid
    corpus when `held_out` is 0)."""

    @property
    def identity(self) -> tuple[str, str | None, float, str]:
        """What makes two parts the same corpus: a blend indexes it once."""
        return self.prefix, self.fingerprint, self.held_out, self.side

    def sequences(self, c: corpus.Corpus) -> np.ndarray:
        """The sequence numbers this part draws from (int32)."""
        docs = c.header.documents
        held = held_out(docs, self.held_out)
        first_valid = int(c.boundaries[docs - held])
        if self.side == "train":
            return np.arange(0, first_valid, dtype=np.int32)
        if held:
            return np.arange(first_valid, c.header.sequences, dtype=np.int32)
        return np.arange(0, c.header.sequences, dtype=np.int32)


def merged(parts: list[Part]) -> list[Part]:
    """`parts` with each corpus once, in the order of its first listing, its weights summed."""
    out: dict[tuple[str, str | None, float, str], Part] = {}
    for p in parts:
        have = out.get(p.identity)
        out[p.identity] = p if have is None else replace(have, weight=have.weight + p.weight)
    return list(out.values())


def key(parts: list[Part], seed: int, seq_len: int, samples: int) -> str:
    """The hash of everything an order depends on: the corpora (path and fingerprint: its
    identity; a part without one, not submitted through the API, is fingerprinted now), the
    seed, seq_len, the sample count, the weights and the split."""
    rows = [[p.prefix, p.fingerprint or fingerprint(p.prefix), p.weight, p.held_out, p.side]
            for p in merged(parts)]
    text = json.dumps({"format": FORMAT, "seed": seed, "seq_len": seq_len, "samples": samples,
                       "parts": rows}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def epoch_documents(seqs: np.ndarray, seed: int, salt: int, epoch: int) -> np.ndarray:
    """The sequences of one epoch of a corpus, in that epoch's shuffled order."""
    return np.random.Generator(np.random.PCG64([seed, salt, epoch])).permutation(seqs)


def shuffled_windows(seed: int, salt: int, per_block: int, count: int) -> np.ndarray:
    """The windows (int64) of a corpus's first `count` samples: block b of `per_block`
    samples is a permutation of windows `[b * per_block, (b + 1) * per_block)`."""
    out = np.empty(count, dtype=np.int64)
    for b in range(-(-count // per_block)):
        lo, hi = b * per_block, min(count, (b + 1) * per_block)
        seeds = [seed, salt, 1 << 20] if b == 0 else [seed, salt, 1 << 20, b]
        perm = np.random.Generator(np.random.PCG64(seeds)).permutation(per_block)
        out[lo:hi] = lo + perm[:hi - lo]
    return out


@dataclass
class _Windows:
    """One corpus's share of an order: its first samples' windows and the sequences each
    spans (`ARRAYS`), and its windows per epoch."""

    window: np.ndarray
    offset: np.ndarray
    counts: np.ndarray
    seqs: np.ndarray
    per_epoch: int


def _corpus_windows(c: corpus.Corpus, seqs: np.ndarray, seed: int, salt: int, seq_len: int,
                    samples: int) -> _Windows:
    """Corpus `c`'s first `samples` samples (of its sequences `seqs`)."""
    lengths = np.asarray(c.lengths)
    tokens = int(lengths[seqs].sum(dtype=np.int64))
    if tokens < seq_len + 1:
        raise corpus.CorpusError(corpus.bin_path(c.prefix), f"{tokens} tokens hold no"
                                 f" sample of seq_len({seq_len}) + 1 tokens")
    per_epoch = (tokens - 1) // seq_len  # Megatron's windows of one epoch
    window = shuffled_windows(seed, salt, per_epoch, samples)
    # Block b's windows end before token (b + 1) * per_epoch * seq_len + 1: within b + 1 epochs.
    epochs = -(-samples // per_epoch) if samples else 0
    doc = np.concatenate([epoch_documents(seqs, seed, salt, e) for e in range(epochs)]) \
        if epochs else np.zeros(0, dtype=seqs.dtype)
    starts = np.zeros(len(doc) + 1, dtype=np.int64)
    np.cumsum(lengths[doc], dtype=np.int64, out=starts[1:])
    first_token = window * seq_len
    first = np.searchsorted(starts, first_token, side="right") - 1
    last = np.searchsorted(starts, first_token + seq_len, side="right") - 1
    counts = last - first + 1
    begin = np.repeat(first - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    spanned = doc[begin + np.arange(int(counts.sum()))]
    return _Windows(window=window, offset=(first_token - starts[first]).astype(np.int32),
                    counts=counts, seqs=spanned, per_epoch=per_epoch)


def compute(parts: list[Part], seed: int, seq_len: int, samples: int
            ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays (`ARRAYS`) and the record of the order of `samples` global samples over
    `parts` (each corpus once: `merged`)."""
    parts = merged(parts)
    which, number = blend([p.weight for p in parts], samples)
    window = np.zeros(samples, dtype=np.int64)
    offset = np.zeros(samples, dtype=np.int32)
    counts = np.zeros(samples, dtype=np.int64)
    source = np.zeros(samples, dtype=np.int64)  # where each sample's sequences are in `pool`
    pool, base, per_epoch = [], 0, []
    for i, part in enumerate(parts):
        c = corpus.Corpus(part.prefix)
        mine = which == i
        w = _corpus_windows(c, part.sequences(c), seed, i, seq_len, int(mine.sum()))
        k = number[mine]
        window[mine], offset[mine], counts[mine] = w.window[k], w.offset[k], w.counts[k]
        source[mine] = base + np.concatenate([[0], np.cumsum(w.counts)[:-1]])[k]
        pool.append(w.seqs)
        base += len(w.seqs)
        per_epoch.append(w.per_epoch)
    ptr = np.zeros(samples + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    flat = np.concatenate(pool) if pool else np.zeros(0, np.int64)
    wide = bool(len(flat)) and int(flat.max()) >= 2**31 - 1
    at = np.repeat(source - ptr[:-1], counts) + np.arange(int(ptr[-1]))
    seqs = flat[at].astype(np.int64 if wide else np.int32)
    record = {"parts": [p.prefix for p in parts], "samples": samples, "seq_len": seq_len,
              "seed": seed, "per_epoch": per_epoch}
    return {"which": which, "window": window, "offset": offset, "ptr": ptr,
            "seqs": seqs}, record


def build(cache: OrderCache, user: str, parts: list[Part], seed: int, seq_len: int,
          samples: int) -> Order:
    """The order of `samples` global samples over `parts`, from the cache, built into it
    first unless some job built it already; counted against `user`'s bound
    (`service.files.order_cache`: CacheRefused when it does not fit). One process calls it; the
    others wait, then `open_order` it."""
    name = key(parts, seed, seq_len, samples)
    pin = cache.reuse(name, user)
    if pin is not None:
        return Order(cache, name, parts, seq_len, pin)
    arrays, record = compute(parts, seed, seq_len, samples)

    def write(folder: Path) -> None:
        for array_name, array in arrays.items():
            np.save(folder / f"{array_name}.npy", array)
        (folder / "order.json").write_text(json.dumps(record))

    sizes = [a.nbytes for a in arrays.values()]
    return Order(cache, name, parts, seq_len, cache.admit(name, user, sizes, write))


def _opened(part: Part) -> corpus.Corpus:
    """`part`'s corpus, opened: CorpusError when the `.bin` opened is not the file of its
    fingerprint (replaced since rank 0 checked it)."""
    c = corpus.Corpus(part.prefix)
    if why := opened_changed(part.prefix, part.fingerprint, c.bin_stat()):
        raise corpus.CorpusError(corpus.bin_path(part.prefix), why.removeprefix(
            f"{part.prefix}: "))
    return c


class Order:
    """A built order, memory-mapped and pinned in the cache (`OrderCache.pin`) while open:
    global sample j's tokens, and where they came from."""

    def __init__(self, cache: OrderCache, name: str, parts: list[Part], seq_len: int,
                 pin: int) -> None:
        self._pin: int | None = pin
        self.folder = cache.folder(name)
        self.parts, self.seq_len = merged(parts), seq_len
        load = lambda n: np.load(self.folder / f"{n}.npy", mmap_mode="r")  # noqa: E731
        self.which, self.window, self.offset, self.ptr, self.seqs = (load(n) for n in ARRAYS)
        self.per_epoch = [float(x) for x in
                          json.loads((self.folder / "order.json").read_text())["per_epoch"]]
        self.corpora = [_opened(p) for p in self.parts]
        self._masks: dict[int, corpus.Corpus] | None = None

    def close(self) -> None:
        """Let the cache delete the entry again (its arrays stay mapped here)."""
        if self._pin is not None:
            os.close(self._pin)
            self._pin = None

    def __del__(self) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.which)

    def source(self, j: int) -> tuple[int, int]:
        """(corpus, that corpus's window) of global sample j."""
        return int(self.which[j]), int(self.window[j])

    def _spans(self, j: int) -> Iterator[tuple[corpus.Corpus, int, int, int, int]]:
        """(corpus, sequence, offset in it, length, where in the window) of each piece of
        the corpus's sequences global sample j is made of, in order."""
        data = self.corpora[int(self.which[j])]
        at, offset = 0, int(self.offset[j])
        for k in range(int(self.ptr[j]), int(self.ptr[j + 1])):
            seq = int(self.seqs[k])
            length = min(self.seq_len + 1 - at, int(data.lengths[seq]) - offset)
            yield data, seq, offset, length, at
            at, offset = at + length, 0
        assert at == self.seq_len + 1, (j, at)

    def tokens(self, j: int, out: np.ndarray | None = None) -> np.ndarray:
        """The `seq_len + 1` tokens (int64) of global sample j, written into `out` when given
        (Megatron's `GPTDataset._query_document_sample_shuffle_indices`)."""
        if out is None:
            out = np.empty(self.seq_len + 1, dtype=np.int64)
        for data, seq, offset, length, at in self._spans(j):
            out[at:at + length] = data.get(seq, offset, length)
        return out

    def documents(self, j: int, out: np.ndarray | None = None) -> np.ndarray:
        """The document of each of global sample j's `seq_len + 1` tokens, numbered 0, 1, ...
        in the window: the corpus's sequences (each a document ending with its EOD token)
        it spans, in order; written into `out` when given."""
        if out is None:
            out = np.empty(self.seq_len + 1, dtype=np.int64)
        for n, (_, _, _, length, at) in enumerate(self._spans(j)):
            out[at:at + length] = n
        return out

    def loss_mask(self, j: int, out: np.ndarray | None = None) -> np.ndarray:
        """The loss mask (`PREFIX_loss_mask` beside each corpus, `trident data prepare
        --chat`) of global sample j's `seq_len + 1` tokens, at the same offsets as `tokens`:
        1 where the token trains; written into `out` when given."""
        if self._masks is None:
            from service.files.chat_prepare import mask_prefix
            self._masks = {id(c): corpus.Corpus(mask_prefix(c.prefix)) for c in self.corpora}
        if out is None:
            out = np.empty(self.seq_len + 1, dtype=np.int64)
        for data, seq, offset, length, at in self._spans(j):
            out[at:at + length] = self._masks[id(data)].get(seq, offset, length)
        return out

    def drawn(self, consumed: int) -> list[int]:
        """Samples each corpus gave to the first `consumed` global samples."""
        counts = np.bincount(np.asarray(self.which[:consumed]), minlength=len(self.parts))
        return [int(x) for x in counts]

    def epochs(self, consumed: int) -> float:
        """Epochs of the (first) training corpus the first `consumed` samples amount to."""
        return self.drawn(consumed)[0] / self.per_epoch[0] if consumed else 0.0


def open_order(cache: OrderCache, parts: list[Part], seed: int, seq_len: int,
               samples: int) -> Order:
    """The order `build` built (FileNotFoundError when it is not in the cache)."""
    name = key(parts, seed, seq_len, samples)
    try:
        pin = cache.pin(name)
    except FileNotFoundError:
        raise FileNotFoundError(f"the sample order {cache.folder(name)} was not built") from None
    return Order(cache, name, parts, seq_len, pin)
