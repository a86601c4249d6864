"""The global sample order: documents shuffled per epoch from the seed, packed into seq_len + 1
windows across document boundaries, blended by Megatron's rule; built once, keyed by a hash,
memory-mapped; equal to what megatron-core's own helpers build."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.corpora import write_corpus
from workers import sample_order
from workers.sample_order import Part, blend, build, open_order


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


def _stream(corpus_docs: list[list[int]], doc_index: np.ndarray) -> list[int]:
    return [t for d in doc_index for t in corpus_docs[int(d)]]


def test_samples_are_windows_of_the_shuffled_epochs(tmp_path: Path) -> None:
    a, b = _docs(30, 1), _docs(12, 2)
    write_corpus(tmp_path / "a", a)
    write_corpus(tmp_path / "b", b)
    parts = [Part(str(tmp_path / "a"), "fa", 3.0), Part(str(tmp_path / "b"), "fb", 1.0)]
    seq_len, samples = 16, 400  # several epochs of b
    folder = build(parts, seed=7, seq_len=seq_len, samples=samples)
    assert folder.startswith(str(tmp_path / ".trident-index"))
    order = open_order(parts, 7, seq_len, samples)
    assert isinstance(order.which, np.memmap)
    streams = [_stream(a, np.asarray(order.doc[0])), _stream(b, np.asarray(order.doc[1]))]
    epochs_seen = set()
    for j in range(samples):
        c, w = order.source(j)
        want = streams[c][w * seq_len:w * seq_len + seq_len + 1]
        assert order.tokens(j).tolist() == want, j
        epochs_seen.add(w * seq_len // sum(map(len, (a, b)[c])))
    assert len(epochs_seen) > 1
    # Each epoch is a permutation of every document, and epochs differ.
    doc_b = np.asarray(order.doc[1]).reshape(-1, 12)
    assert all(sorted(row) == list(range(12)) for row in doc_b)
    assert not np.array_equal(doc_b[0], doc_b[1])
    assert order.drawn(400) == [300, 100]


def test_the_order_is_built_once_and_depends_on_its_inputs(tmp_path: Path) -> None:
    write_corpus(tmp_path / "a", _docs(30, 1))
    parts = [Part(str(tmp_path / "a"), "f1")]
    first = build(parts, 1, 16, 50)
    stamp = os.stat(os.path.join(first, "done.json")).st_mtime_ns
    assert build(parts, 1, 16, 50) == first
    assert os.stat(os.path.join(first, "done.json")).st_mtime_ns == stamp
    others = {build(parts, 2, 16, 50), build(parts, 1, 8, 50), build(parts, 1, 16, 60),
              build([Part(str(tmp_path / "a"), "f2")], 1, 16, 50)}
    assert first not in others and len(others) == 4
    again = open_order(parts, 1, 16, 50)
    same = open_order(parts, 1, 16, 50)
    assert [again.tokens(j).tolist() for j in range(50)] == \
        [same.tokens(j).tolist() for j in range(50)]
    with pytest.raises(FileNotFoundError, match="was not built"):
        open_order(parts, 3, 16, 50)


def test_held_out_documents_never_train(tmp_path: Path) -> None:
    docs = [[i] * 20 for i in range(20)]  # document i is made of token i
    write_corpus(tmp_path / "a", docs)
    train = [Part(str(tmp_path / "a"), "f", held_out=0.25, side="train")]
    valid = [Part(str(tmp_path / "a"), "f", held_out=0.25, side="valid")]
    build(train, 1, 8, 100)
    build(valid, 1, 8, 20)
    seen_train = {t for j in range(100) for t in open_order(train, 1, 8, 100).tokens(j)}
    seen_valid = {t for j in range(20) for t in open_order(valid, 1, 8, 20).tokens(j)}
    assert seen_train == set(range(15)) and seen_valid == set(range(15, 20))
