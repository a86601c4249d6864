"""The global sample order: documents shuffled per epoch from the seed, packed into seq_len + 1
windows across document boundaries (where megatron-core's own `build_sample_idx` puts them),
blended by Megatron's rule; a sample the same whatever a job's length; each corpus of a blend
indexed once; built once into the cache, keyed by a hash, memory-mapped."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from service.files.corpus import Corpus
from service.files.data_check import fingerprint
from service.files.order_cache import OrderCache
from tests.corpora import write_corpus
from workers.trainer import sample_order
from workers.trainer.sample_order import Part, blend, build, epoch_documents, open_order


def _docs(n: int, seed: int, vocab: int = 256) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(3, 90))).tolist() for _ in range(n)]


def test_blends_honour_their_weights_within_one_percent() -> None:
    weights = [0.7, 0.2, 0.1]
    which, number = blend(weights, 10_000)
    counts = np.bincount(which, minlength=3)
    for got, w in zip(counts, weights, strict=True):
        assert abs(got / 10_000 - w) < 0.01, counts
    # Each corpus's samples are taken in order, one after another.
    for c in range(3):
        assert number[which == c].tolist() == list(range(counts[c]))
    # And unnormalised weights mean the same shares (ties may break the other way).
    assert np.abs(np.bincount(blend([7, 2, 1], 10_000)[0], minlength=3) - counts).max() <= 1


def test_the_helpers_are_megatrons_own() -> None:
    from megatron.core.datasets import helpers as megatron_helpers

    sizes = np.array([5, 9, 2, 30, 7], np.int32)
    doc = np.array([3, 0, 4, 1, 2, 2, 1, 0, 4, 3], np.int32)
    ours = sample_order.helpers().build_sample_idx_int32(sizes, doc, 8, 2, 53, True, 1)
    theirs = megatron_helpers.build_sample_idx(sizes, doc, 8, 2, 53)
    assert np.array_equal(ours, theirs)
    which, number = np.zeros(100, np.int16), np.zeros(100, np.int64)
    megatron_helpers.build_blending_indices(which, number, np.array([0.5, 0.3, 0.2]), 3, 100,
                                            False)
    assert np.array_equal(blend([0.5, 0.3, 0.2], 100)[0], which)


def _part(prefix: Path | str, weight: float = 1.0, **kw: object) -> Part:
    """A part of corpus `prefix` fingerprinted as submission does."""
    return Part(str(prefix), fingerprint(str(prefix)), weight, **kw)  # type: ignore[arg-type]


def _stream(corpus_docs: list[list[int]], doc_index: np.ndarray) -> list[int]:
    return [t for d in doc_index for t in corpus_docs[int(d)]]


@pytest.fixture
def cache(tmp_path: Path) -> OrderCache:
    return OrderCache(tmp_path / "orders", user_bytes=1 << 30, total_bytes=1 << 30)


def _epochs(parts: list[Part], i: int, n: int, seed: int) -> np.ndarray:
    seqs = np.arange(len(Corpus(parts[i].prefix)), dtype=np.int32)
    return np.concatenate([epoch_documents(seqs, seed, i, e) for e in range(n)])


def test_samples_are_windows_of_the_shuffled_epochs(tmp_path: Path, cache: OrderCache) -> None:
    a, b = _docs(30, 1), _docs(12, 2)
    write_corpus(tmp_path / "a", a)
    write_corpus(tmp_path / "b", b)
    parts = [_part(tmp_path / "a", 3.0), _part(tmp_path / "b", 1.0)]
    seq_len, samples = 16, 400  # several epochs of b
    order = build(cache, "alice", parts, seed=7, seq_len=seq_len, samples=samples)
    assert str(order.folder).startswith(str(cache.root))
    assert not (tmp_path / ".trident-index").exists()  # nothing beside the corpora
    assert isinstance(order.which, np.memmap)
    doc = [_epochs(parts, 0, 3, 7), _epochs(parts, 1, 12, 7)]
    streams = [_stream(a, doc[0]), _stream(b, doc[1])]
    epochs_seen = set()
    for j in range(samples):
        c, w = order.source(j)
        want = streams[c][w * seq_len:w * seq_len + seq_len + 1]
        assert order.tokens(j).tolist() == want, j
        epochs_seen.add(w * seq_len // sum(map(len, (a, b)[c])))
    assert len(epochs_seen) > 1
    # Each epoch is a permutation of every document, and epochs differ.
    doc_b = doc[1].reshape(-1, 12)
    assert all(sorted(row) == list(range(12)) for row in doc_b)
    assert not np.array_equal(doc_b[0], doc_b[1])
    assert order.drawn(400) == [300, 100]
    # Each corpus's samples are its windows, each epoch's worth once.
    per_epoch = order.per_epoch[1]
    windows_b = [order.source(j)[1] for j in range(samples) if order.source(j)[0] == 1]
    assert sorted(windows_b[:int(per_epoch)]) == list(range(int(per_epoch)))


def test_the_windows_are_megatrons(tmp_path: Path, cache: OrderCache) -> None:
    """Where each window starts and ends (sequence position and offset) is what
    megatron-core's `build_sample_idx` says for the same shuffled documents."""
    from megatron.core.datasets import helpers as megatron_helpers

    docs = _docs(25, 3)
    write_corpus(tmp_path / "a", docs)
    parts = [_part(tmp_path / "a")]
    seq_len, samples = 8, 500
    order = build(cache, "alice", parts, 5, seq_len, samples)
    tokens = sum(map(len, docs))
    epochs = -(-samples // ((tokens - 1) // seq_len))
    doc = _epochs(parts, 0, epochs, 5)
    sizes = np.array([len(d) for d in docs], np.int32)
    theirs = megatron_helpers.build_sample_idx(sizes, doc, seq_len, epochs, tokens)
    for j in range(samples):
        _, w = order.source(j)
        (beg, beg_off), (end, end_off) = theirs[w], theirs[w + 1]
        lo, hi = int(order.ptr[j]), int(order.ptr[j + 1])
        assert np.asarray(order.seqs[lo:hi]).tolist() == doc[beg:end + 1].tolist(), j
        assert int(order.offset[j]) == beg_off, j
        spanned = [len(docs[int(d)]) for d in doc[beg:end + 1]]
        spanned[-1] = end_off + 1  # Megatron's window ends at token end_off of sequence end
        spanned[0] -= beg_off
        assert sum(spanned) == seq_len + 1


def test_a_sample_does_not_depend_on_how_many_a_job_takes(tmp_path: Path,
                                                          cache: OrderCache) -> None:
    write_corpus(tmp_path / "a", _docs(30, 1))
    write_corpus(tmp_path / "b", _docs(12, 2))
    parts = [_part(tmp_path / "a", 2.0), _part(tmp_path / "b")]
    short = build(cache, "alice", parts, 3, 16, 40)
    long = build(cache, "alice", parts, 3, 16, 600)  # several epochs of both
    assert short.folder != long.folder
    assert [short.tokens(j).tolist() for j in range(40)] == \
        [long.tokens(j).tolist() for j in range(40)]


def test_one_corpus_listed_twice_is_indexed_once(tmp_path: Path, cache: OrderCache) -> None:
    write_corpus(tmp_path / "a", _docs(30, 1))
    write_corpus(tmp_path / "b", _docs(12, 2))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    listed = [_part(a, 1.0), _part(b, 1.0), _part(a, 2.0)]
    once = [_part(a, 3.0), _part(b, 1.0)]
    twice = build(cache, "alice", listed, 1, 16, 100)
    assert [p.prefix for p in twice.parts] == [a, b]
    assert twice.drawn(100) == [75, 25]
    same = build(cache, "alice", once, 1, 16, 100)
    assert same.folder == twice.folder  # the same order: one entry


def test_the_order_is_built_once_and_depends_on_its_inputs(tmp_path: Path,
                                                           cache: OrderCache) -> None:
    write_corpus(tmp_path / "a", _docs(30, 1))
    parts = [_part(tmp_path / "a")]
    rewritten = tmp_path / "again" / "a"  # the same tokens in another corpus
    rewritten.parent.mkdir()
    write_corpus(rewritten, _docs(30, 1))
    first = build(cache, "alice", parts, 1, 16, 50).folder
    stamp = os.stat(first / "which.npy").st_mtime_ns
    assert build(cache, "alice", parts, 1, 16, 50).folder == first
    assert os.stat(first / "which.npy").st_mtime_ns == stamp
    others = {build(cache, "alice", parts, 2, 16, 50).folder,
              build(cache, "alice", parts, 1, 8, 50).folder,
              build(cache, "alice", parts, 1, 16, 60).folder,
              build(cache, "alice", [_part(rewritten)], 1, 16, 50).folder}
    assert first not in others and len(others) == 4
    again = open_order(cache, parts, 1, 16, 50)
    same = open_order(cache, parts, 1, 16, 50)
    assert [again.tokens(j).tolist() for j in range(50)] == \
        [same.tokens(j).tolist() for j in range(50)]
    with pytest.raises(FileNotFoundError, match="was not built"):
        open_order(cache, parts, 3, 16, 50)


def test_held_out_documents_never_train(tmp_path: Path, cache: OrderCache) -> None:
    docs = [[i] * 20 for i in range(20)]  # document i is made of token i
    write_corpus(tmp_path / "a", docs)
    train = [_part(tmp_path / "a", held_out=0.25, side="train")]
    valid = [_part(tmp_path / "a", held_out=0.25, side="valid")]
    build(cache, "alice", train, 1, 8, 100)
    build(cache, "alice", valid, 1, 8, 20)
    seen_train = {t for j in range(100) for t in open_order(cache, train, 1, 8, 100).tokens(j)}
    seen_valid = {t for j in range(20) for t in open_order(cache, valid, 1, 8, 20).tokens(j)}
    assert seen_train == set(range(15)) and seen_valid == set(range(15, 20))
