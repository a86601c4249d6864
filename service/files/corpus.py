"""A tokenized corpus on disk: Megatron's indexed dataset (`PREFIX.bin` + `PREFIX.idx`).

The format is Megatron-LM's (`megatron.core.datasets.indexed_dataset`), so corpora prepared
with Megatron's `preprocess_data.py` load here unchanged and Trident's load in Megatron:

- `PREFIX.bin`: the tokens of every sequence, back to back, in the index's dtype;
- `PREFIX.idx`: the 9-byte magic `MMIDIDX\\x00\\x00`, version (u64 little-endian, 1), dtype code
  (u8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), the
  sequence count n (u64), the document count d + 1 (u64), then n int32 sequence lengths, n int64
  byte offsets into `.bin`, and d + 1 int64 document boundaries (indices into the sequences,
  from 0 to n).

Trident writes corpora with Megatron's own `IndexedDatasetBuilder` (`service.files.corpus_prepare`).
It reads them with this module rather than Megatron's `IndexedDataset` because that one needs
`megatron.core` imported (seconds, and the whole GPU model stack) in the API process that checks
every `.idx` at submission, and it stops on a bad file with a bare assertion; here every check
names its file and reason (`CorpusError`). Both directions are tested against Megatron itself
(tests/test_corpus.py). The checks (`read_header`, `check`) read both files in bounded chunks
with `pread`, regular files only: what the API spends on a submission's corpus does not grow
with its sequences or tokens. A rank's index is memory-mapped; the tokens it trains on are
read with
`pread` (as Megatron's `_FileBinReader` does with `mmap=False`), so that neither a rank's
anonymous nor its file-backed resident memory grows with the corpus: a mapping of the `.bin`
would count every page the kernel maps around each read (fault-around) as the rank's, gigabytes
over a large corpus (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from service.contract.specfiles import FileRefused, open_regular

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34
"""Magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)."""
DTYPES: dict[int, type[np.number]] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
                                      5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
"""Megatron's `DType` codes."""
TOKEN_DTYPES = (1, 3, 4, 5, 8)
"""The codes a token corpus may use (integers; Megatron writes uint16 or int32)."""
SCAN_CHUNK = 4 << 20
"""Tokens read at once when scanning a `.bin` for its largest token id (at most 32 MiB)."""
CHECK_CHUNK = 1 << 18
"""Sequences (or document boundaries) of an `.idx` read at once when checking it: a few MiB,
however many sequences the corpus has."""


class CorpusError(ValueError):
    """A corpus that cannot be trained on: the file and the reason."""

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file = file
        self.reason = reason


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def token_dtype(vocab: int) -> type[np.number]:
    """The dtype Megatron's `DType.optimal_dtype` picks for a vocabulary of `vocab` ids."""
    return np.uint16 if vocab is not None and vocab < 65500 else np.int32


@dataclass(frozen=True)
class Header:
    """What a corpus's `.idx` says, checked against its `.bin`."""

    prefix: str
    dtype_code: int
    sequences: int
    documents: int
    """Documents (the boundary count minus one)."""
    tokens: int
    idx_bytes: int
    bin_bytes: int

    @property
    def dtype(self) -> type[np.number]:
        return DTYPES[self.dtype_code]


def read_header(prefix: str, tokens: int | None = None) -> Header:
    """The header of corpus `prefix`, after checking that both files exist and are regular
    files, the magic, version and dtype are Megatron's, the `.idx` holds exactly its arrays,
    the document boundaries run from 0 to the sequence count without going back, the byte
    offsets are those of the lengths and the `.bin` holds exactly the tokens the lengths count.
    CorpusError otherwise. The arrays are read `CHECK_CHUNK` sequences at a time: the memory
    it takes does not grow with the corpus. With `tokens` (the count a record of these very
    files says: `service.files.corpus_scan`, made after this check passed on them), the arrays
    are not read again: the fixed header, the `.idx`'s size and the `.bin`'s against `tokens`
    are checked, whatever the corpus's size."""
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    for path in (ipath, bpath):
        if not os.path.isfile(path):
            raise CorpusError(path, "no such file" if not os.path.lexists(path)
                              else "not a regular file")
    try:
        bin_bytes = os.path.getsize(bpath)
        with _opened(ipath) as fd:
            idx_bytes = os.fstat(fd).st_size
            return _checked(prefix, fd, idx_bytes, bin_bytes, tokens)
    except OSError as exc:
        raise CorpusError(ipath, f"cannot be read ({exc.strerror})") from None


@contextmanager
def _opened(path: str) -> Iterator[int]:
    """A descriptor of the regular file `path` (CorpusError when it is none: a FIFO would
    make its reader wait for a writer)."""
    try:
        fd = open_regular(path)
    except FileRefused:
        raise CorpusError(path, "not a regular file") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _checked(prefix: str, fd: int, idx_bytes: int, bin_bytes: int,
             known: int | None) -> Header:
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    head = os.pread(fd, HEADER_BYTES, 0)
    if len(head) < HEADER_BYTES or head[:9] != MAGIC:
        raise CorpusError(ipath, f"wrong magic {head[:9]!r}: not a Megatron indexed dataset"
                          f" index (expected {MAGIC!r})")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise CorpusError(ipath, f"wrong version {version}: Megatron's indexed dataset is"
                          f" version {VERSION}")
    code = head[17]
    if code not in TOKEN_DTYPES:
        raise CorpusError(ipath, f"dtype code {code} is not an integer token type (one of"
                          f" {', '.join(f'{c} {DTYPES[c].__name__}' for c in TOKEN_DTYPES)})")
    n, d = struct.unpack("<QQ", head[18:34])
    expected = HEADER_BYTES + 4 * n + 8 * n + 8 * d
    if idx_bytes != expected:
        raise CorpusError(ipath, f"counts disagree with the file's size: {n} sequences and {d}"
                          f" document boundaries need {expected} bytes, the file has"
                          f" {idx_bytes}")
    if d < 1:
        raise CorpusError(ipath, "no document boundaries (a Megatron index holds at least 0)")
    size = np.dtype(DTYPES[code]).itemsize
    if known is not None:
        tokens = known
    else:
        _check_boundaries(ipath, fd, n, d)
        tokens = _check_offsets(ipath, fd, n, size)
    if bin_bytes != tokens * size:
        raise CorpusError(bpath, f"counts disagree with the file's size: the index counts"
                          f" {tokens} tokens of {size} bytes = {tokens * size} bytes, the file"
                          f" has {bin_bytes}")
    return Header(prefix=prefix, dtype_code=code, sequences=n, documents=d - 1, tokens=tokens,
                  idx_bytes=idx_bytes, bin_bytes=bin_bytes)


def _read(path: str, fd: int, dtype: type[np.number], offset: int, count: int) -> np.ndarray:
    """`count` items of `dtype` at byte `offset` of the open file `fd`."""
    want = count * np.dtype(dtype).itemsize
    raw = os.pread(fd, want, offset)
    if len(raw) != want:
        raise CorpusError(path, "shorter than its header says: it changed while being read")
    return np.frombuffer(raw, dtype=dtype)


def _check_boundaries(ipath: str, fd: int, n: int, d: int) -> None:
    """The `d` document boundaries run from 0 to `n` without going back (read in chunks)."""
    base = HEADER_BYTES + 12 * n
    first = int(_read(ipath, fd, np.int64, base, 1)[0])
    last = int(_read(ipath, fd, np.int64, base + 8 * (d - 1), 1)[0])
    back = False
    prev = first
    for start in range(0, d, CHECK_CHUNK):
        docs = _read(ipath, fd, np.int64, base + 8 * start, min(CHECK_CHUNK, d - start))
        if docs[0] < prev or bool(np.any(docs[1:] < docs[:-1])):
            back = True
            break
        prev = int(docs[-1])
    if first != 0 or last != n or back:
        raise CorpusError(ipath, f"document boundaries must run from 0 to the sequence count"
                          f" {n} without going back; they run from {first} to {last}")


def _check_offsets(ipath: str, fd: int, n: int, size: int) -> int:
    """The tokens the `n` sequence lengths count, after checking that none is negative and
    that each byte offset is the sum of the lengths before it (read in chunks)."""
    tokens = 0
    for start in range(0, n, CHECK_CHUNK):
        count = min(CHECK_CHUNK, n - start)
        lengths = _read(ipath, fd, np.int32, HEADER_BYTES + 4 * start, count)
        if bool(np.any(lengths < 0)):
            raise CorpusError(ipath, "a sequence length is negative")
        pointers = _read(ipath, fd, np.int64, HEADER_BYTES + 4 * n + 8 * start, count)
        want = np.empty(count, dtype=np.int64)
        want[0] = tokens * size
        np.cumsum(lengths[:-1].astype(np.int64) * size, out=want[1:])
        want[1:] += tokens * size
        if not np.array_equal(want, pointers):
            first = int(np.argmax(want != pointers))
            raise CorpusError(ipath, f"the byte offset of sequence {start + first} is"
                              f" {int(pointers[first])}, its preceding lengths put it at"
                              f" {int(want[first])}")
        tokens += int(lengths.sum(dtype=np.int64))
    return tokens


def tokens_from(header: Header, first_seq: int) -> int:
    """Tokens of the sequences from `first_seq` to the end of corpus `header` (read in chunks
    of its `.idx`)."""
    ipath, n = idx_path(header.prefix), header.sequences
    total = 0
    with _opened(ipath) as fd:
        for start in range(first_seq, n, CHECK_CHUNK):
            lengths = _read(ipath, fd, np.int32, HEADER_BYTES + 4 * start,
                            min(CHECK_CHUNK, n - start))
            total += int(lengths.sum(dtype=np.int64))
    return total


def boundary(header: Header, document: int) -> int:
    """The first sequence of document `document` of corpus `header`."""
    ipath = idx_path(header.prefix)
    with _opened(ipath) as fd:
        offset = HEADER_BYTES + 12 * header.sequences + 8 * document
        return int(_read(ipath, fd, np.int64, offset, 1)[0])


def _arrays(ipath: str, n: int, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The lengths (int32), byte offsets (int64) and document boundaries (int64), mapped."""
    lengths = np.memmap(ipath, dtype=np.int32, mode="r", offset=HEADER_BYTES, shape=(n,)) \
        if n else np.zeros(0, np.int32)
    pointers = np.memmap(ipath, dtype=np.int64, mode="r", offset=HEADER_BYTES + 4 * n,
                         shape=(n,)) if n else np.zeros(0, np.int64)
    docs = np.memmap(ipath, dtype=np.int64, mode="r", offset=HEADER_BYTES + 12 * n, shape=(d,))
    return lengths, pointers, docs


def bin_chunks(header: Header) -> Iterator[tuple[int, np.ndarray]]:
    """(first token, tokens) of the corpus's `.bin`, `SCAN_CHUNK` tokens at a time, read into
    one buffer (no mapping: the pages read do not stay the reader's)."""
    path = bin_path(header.prefix)
    buf = np.empty(min(SCAN_CHUNK, header.tokens), dtype=header.dtype)
    size = buf.itemsize
    with _opened(path) as fd:
        for start in range(0, header.tokens, SCAN_CHUNK):
            chunk = buf[:min(SCAN_CHUNK, header.tokens - start)]
            view = chunk.data.cast("B")
            got = os.preadv(fd, [view], start * size)
            if got != len(view):
                raise CorpusError(path, "shorter than its index says: it changed while being"
                                  " read")
            yield start, chunk


def max_token(header: Header) -> int:
    """The largest token id in the corpus's `.bin` (-1 when it holds none), read in chunks of
    `SCAN_CHUNK` tokens so that memory stays bounded."""
    return max((int(chunk.max()) for _, chunk in bin_chunks(header)), default=-1)


def check(prefix: str, vocab: int) -> Header:
    """`read_header`, then CorpusError when a token id is at or above `vocab`, or is negative.
    The `.bin` is scanned (in chunks) unless its dtype cannot hold an id that large."""
    header = read_header(prefix)
    if header.dtype_code in (1, 8) and (255 if header.dtype_code == 1 else 65535) < vocab:
        return header  # every id the dtype can hold is inside the vocabulary
    for start, chunk in bin_chunks(header):
        top, low = int(chunk.max()), int(chunk.min())
        if top >= vocab:
            where = start + int(np.argmax(chunk >= vocab))
            raise CorpusError(bin_path(prefix), f"token id {top} (first at token {where}) is at"
                              f" or above the model's vocabulary model.vocab({vocab})")
        if low < 0:
            raise CorpusError(bin_path(prefix), f"token id {low} is negative")
    return header


class Corpus:
    """A corpus opened for reading: its index arrays and its tokens, memory-mapped."""

    def __init__(self, prefix: str) -> None:
        self.header = read_header(prefix)
        h = self.header
        self.prefix = prefix
        self.lengths, self.pointers, self.boundaries = _arrays(
            idx_path(prefix), h.sequences, h.documents + 1)
        self._size = np.dtype(h.dtype).itemsize
        self._fd = os.open(bin_path(prefix), os.O_RDONLY)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def bin_stat(self) -> os.stat_result:
        """The status of the `.bin` this object reads (opened once, whatever its path names
        since)."""
        return os.fstat(self._fd)

    @cached_property
    def tokens(self) -> np.ndarray:
        """Every token, memory-mapped (for scans: `inspect`, tests; training reads `get`)."""
        h = self.header
        return np.memmap(bin_path(self.prefix), dtype=h.dtype, mode="r", shape=(h.tokens,)) \
            if h.tokens else np.zeros(0, h.dtype)

    def __len__(self) -> int:
        """Sequences (Megatron's `len(IndexedDataset)`)."""
        return self.header.sequences

    @cached_property
    def starts(self) -> np.ndarray:
        """Token offset of each sequence in `.bin` (its byte offset / the dtype's size)."""
        return self.pointers // self._size

    def get(self, seq: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence `seq` from `offset`, `length` of them (default: to its end), as
        Megatron's `IndexedDataset.get`, read from the file."""
        size = int(self.lengths[seq])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens {offset}..{offset + length} of sequence"
                             f" {seq}, which has {size}")
        nbytes = length * self._size
        raw = os.pread(self._fd, nbytes, int(self.pointers[seq]) + offset * self._size)
        if len(raw) != nbytes:
            raise CorpusError(bin_path(self.prefix), f"shorter than its index says (sequence"
                              f" {seq}): it changed while being read")
        return np.frombuffer(raw, dtype=self.header.dtype)

    def __getitem__(self, seq: int) -> np.ndarray:
        return self.get(seq)
