"""The global sample order of a job's corpora: which tokens global sample `i` is, for every i,
the same on every rank and under every TP x PP x DP layout.

It follows Megatron's `GPTDataset` and `BlendedDataset` (megatron/core/datasets), and uses
their own compiled helpers (`helpers_cpp`, shipped built in the megatron-core wheel, loaded
from its file so that `megatron.core`'s GPU model stack is not imported):

- per corpus, its documents (Megatron's sequences; the training or the held-out ones) are
  shuffled per epoch from the seed (`document_index`, one permutation per epoch), the epochs
  concatenated and cut into windows of `seq_len + 1` tokens that cross document boundaries
  (`build_sample_idx`: window i starts where window i - 1 ends, less the one token they share
  as last label and first input), then the windows are shuffled (`shuffle_index`);
- a blend of corpora draws global sample j from the corpus furthest below its share of the
  j samples drawn so far (`build_blending_indices`), taking that corpus's next window.

The index arrays are built once, by one process (`build`), for as many samples as the job
needs, saved as `.npy` in a folder keyed by a hash of everything they depend on (the corpora
and their fingerprints, the seed, seq_len, the sample count, the weights, the split), and
memory-mapped by every rank (`open_order`): a rank's memory does not grow with the corpus.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from service import corpus
from service.data_check import held_out

FORMAT = 1
"""Bumped when the index files change meaning: a new hash, a new folder."""
CACHE_DIR = ".trident-index"
"""The folder, beside the first training corpus, that holds the built orders."""


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
    sample number (int64)."""
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


def key(parts: list[Part], seed: int, seq_len: int, samples: int) -> str:
    """The hash of everything an order depends on."""
    text = json.dumps({"format": FORMAT, "seed": seed, "seq_len": seq_len, "samples": samples,
                       "parts": [[p.prefix, p.fingerprint, p.weight, p.held_out, p.side]
                                 for p in parts]}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def folder_for(parts: list[Part], seed: int, seq_len: int, samples: int) -> str:
    base = os.path.join(os.path.dirname(parts[0].prefix), CACHE_DIR)
    return os.path.join(base, key(parts, seed, seq_len, samples))


def _corpus_order(c: corpus.Corpus, seqs: np.ndarray, seed: int, salt: int, seq_len: int,
                  samples: int, out: str) -> None:
    """Corpus `c`'s document, sample and shuffle indices for at least `samples` windows,
    saved in `out` as `doc.npy`, `sample.npy`, `shuffle.npy`."""
    sizes = np.asarray(c.lengths, dtype=np.int32)
    per_epoch = int(sizes[seqs].sum(dtype=np.int64))
    if per_epoch < seq_len + 1:
        raise corpus.CorpusError(corpus.bin_path(c.prefix), f"{per_epoch} tokens hold no"
                                 f" sample of seq_len({seq_len}) + 1 tokens")
    epochs = 1
    while (epochs * per_epoch - 1) // seq_len < samples:
        epochs += 1
    doc = np.empty(epochs * len(seqs), dtype=np.int32)
    for e in range(epochs):
        rng = np.random.Generator(np.random.PCG64([seed, salt, e]))
        doc[e * len(seqs):(e + 1) * len(seqs)] = rng.permutation(seqs)
    h = helpers()
    build = h.build_sample_idx_int32 if max(len(doc), int(sizes.max())) < 2**31 - 1 \
        else h.build_sample_idx_int64
    sample = build(sizes, doc, seq_len, epochs, per_epoch, True, 1)
    count = len(sample) - 1
    rng = np.random.Generator(np.random.PCG64([seed, salt, 1 << 20]))
    shuffle = rng.permutation(count).astype(np.int64)
    np.save(os.path.join(out, "doc.npy"), doc)
    np.save(os.path.join(out, "sample.npy"), sample)
    np.save(os.path.join(out, "shuffle.npy"), shuffle)
    with open(os.path.join(out, "epoch.json"), "w") as f:
        json.dump({"samples_per_epoch": count / epochs, "epochs": epochs}, f)


def build(parts: list[Part], seed: int, seq_len: int, samples: int) -> str:
    """Build the order of `samples` global samples over `parts` (unless built already) and
    return its folder. One process calls it; the others wait, then `open_order` it."""
    final = folder_for(parts, seed, seq_len, samples)
    if os.path.isfile(os.path.join(final, "done.json")):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(final))
    try:
        which, number = blend([p.weight for p in parts], samples)
        np.save(os.path.join(tmp, "blend_corpus.npy"), which)
        np.save(os.path.join(tmp, "blend_sample.npy"), number)
        for i, part in enumerate(parts):
            c = corpus.Corpus(part.prefix)
            need = int((which == i).sum())
            sub = os.path.join(tmp, f"corpus{i}")
            os.mkdir(sub)
            _corpus_order(c, part.sequences(c), seed, i, seq_len, max(need, 1), sub)
        with open(os.path.join(tmp, "done.json"), "w") as f:
            json.dump({"parts": [p.prefix for p in parts], "samples": samples,
                       "seq_len": seq_len, "seed": seed}, f)
        try:
            os.rename(tmp, final)
        except OSError:  # built meanwhile by another job with the same inputs
            if not os.path.isfile(os.path.join(final, "done.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


class Order:
    """A built order, memory-mapped: global sample j's tokens, and where they came from."""

    def __init__(self, folder: str, parts: list[Part], seq_len: int) -> None:
        self.folder, self.parts, self.seq_len = folder, parts, seq_len
        load = lambda name: np.load(os.path.join(folder, name), mmap_mode="r")  # noqa: E731
        self.which = load("blend_corpus.npy")
        self.number = load("blend_sample.npy")
        self.corpora = [corpus.Corpus(p.prefix) for p in parts]
        self.doc = [load(f"corpus{i}/doc.npy") for i in range(len(parts))]
        self.sample = [load(f"corpus{i}/sample.npy") for i in range(len(parts))]
        self.shuffle = [load(f"corpus{i}/shuffle.npy") for i in range(len(parts))]
        self.per_epoch = []
        for i in range(len(parts)):
            with open(os.path.join(folder, f"corpus{i}", "epoch.json")) as f:
                self.per_epoch.append(float(json.load(f)["samples_per_epoch"]))

    def __len__(self) -> int:
        return len(self.which)

    def source(self, j: int) -> tuple[int, int]:
        """(corpus, that corpus's window) of global sample j."""
        c = int(self.which[j])
        return c, int(self.shuffle[c][int(self.number[j])])

    def tokens(self, j: int, out: np.ndarray | None = None) -> np.ndarray:
        """The `seq_len + 1` tokens (int64) of global sample j, written into `out` when given
        (Megatron's `GPTDataset._query_document_sample_shuffle_indices`)."""
        c, w = self.source(j)
        data, doc, sample = self.corpora[c], self.doc[c], self.sample[c]
        beg, beg_off = (int(x) for x in sample[w])
        end, end_off = (int(x) for x in sample[w + 1])
        if out is None:
            out = np.empty(self.seq_len + 1, dtype=np.int64)
        at = 0
        for i in range(beg, end + 1):
            offset = beg_off if i == beg else 0
            length = (end_off + 1 if i == end else int(data.lengths[int(doc[i])])) - offset
            out[at:at + length] = data.get(int(doc[i]), offset, length)
            at += length
        assert at == self.seq_len + 1, (j, at)
        return out

    def drawn(self, consumed: int) -> list[int]:
        """Samples each corpus gave to the first `consumed` global samples."""
        counts = np.bincount(np.asarray(self.which[:consumed]), minlength=len(self.parts))
        return [int(x) for x in counts]

    def epochs(self, consumed: int) -> float:
        """Epochs of the (first) training corpus the first `consumed` samples amount to."""
        return self.drawn(consumed)[0] / self.per_epoch[0] if consumed else 0.0


def open_order(parts: list[Part], seed: int, seq_len: int, samples: int) -> Order:
    folder = folder_for(parts, seed, seq_len, samples)
    if not os.path.isfile(os.path.join(folder, "done.json")):
        raise FileNotFoundError(f"the sample order {folder} was not built")
    return Order(folder, parts, seq_len)
