"""Turning text into a corpus (`trident data prepare`), and describing one (`trident data
inspect`).

Inputs: `.jsonl` (one JSON object per line, its text in `field`), `.txt` (a whole file is one
document) or `.parquet` (the `field` column). Each document is tokenized as the model expects
it: the tokenizer's BOS first where its configuration adds one, then the text, then its
end-of-document token (EOS), by a pool of `workers` processes (tokenizing is the costly
part); the parent writes the documents in input order with Megatron's own
`IndexedDatasetBuilder`, so the result is a Megatron indexed dataset by construction (read back
by `service.files.corpus`). The files are written under temporary names and renamed when complete:
a corpus at `PREFIX` is never half written. Its largest token id and token count are written
beside it, in `PREFIX.meta.json` (`service.files.corpus_scan`), so that no submission reads its
`.bin` to check it against a vocabulary.

Tokenizers (`gpt2`, a Hugging Face tokenizer folder or `tokenizer.json`) and how each puts
BOS and EOS around a document: `service.files.tokenizer`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.files import corpus, corpus_scan
from service.files.tokenizer import PrepareError, Tokenizer, load_tokenizer  # noqa: F401

INPUT_SUFFIXES = (".jsonl", ".txt", ".parquet")
CHUNK_DOCS = 64
"""Documents sent to a worker at once."""
MAX_DOC_CHARS = 64 << 20
"""The longest document (characters) read; a longer one is refused, naming its input."""


def megatron_builder() -> Any:
    """megatron-core's `IndexedDatasetBuilder`, imported without the warnings its package
    prints about the GPU libraries (Transformer Engine, Apex) a builder does not use."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    return IndexedDatasetBuilder


# --- inputs -------------------------------------------------------------------------------------

def documents(path: str, field: str) -> Iterator[str]:
    """The documents of one input file, in order."""
    if not os.path.isfile(path):
        raise PrepareError(f"{path}: no such file")
    if path.endswith(".jsonl"):
        yield from _jsonl(path, field)
    elif path.endswith(".txt"):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(MAX_DOC_CHARS + 1)
        if len(text) > MAX_DOC_CHARS:
            raise PrepareError(f"{path}: longer than {MAX_DOC_CHARS} characters")
        yield text
    elif path.endswith(".parquet"):
        yield from _parquet(path, field)
    else:
        raise PrepareError(f"{path}: not {', '.join(INPUT_SUFFIXES[:-1])} or"
                           f" {INPUT_SUFFIXES[-1]}")


def _jsonl(path: str, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise PrepareError(f"{path}:{number}: not JSON ({exc})") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise PrepareError(f"{path}:{number}: no text field {field!r}")
            yield text


def _parquet(path: str, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    if field not in table.schema_arrow.names:
        raise PrepareError(f"{path}: no column {field!r} (columns:"
                           f" {', '.join(table.schema_arrow.names[:20])})")
    for batch in table.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str):
                yield text


def _chunks(inputs: list[str], field: str) -> Iterator[list[str]]:
    chunk: list[str] = []
    for path in inputs:
        for doc in documents(path, field):
            chunk.append(doc)
            if len(chunk) == CHUNK_DOCS:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


# --- the worker pool ----------------------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(spec)


def _encode_chunk(docs: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """Tokens of `docs` (each after the BOS, if any, and followed by the end-of-document
    token), their lengths, bytes."""
    tok = _worker_tokenizer
    assert tok is not None
    ids: list[int] = []
    lengths = []
    for doc in docs:
        encoded = [tok.bos] if tok.bos is not None else []
        encoded += tok.encode(doc)
        encoded.append(tok.eod)
        ids.extend(encoded)
        lengths.append(len(encoded))
    return (np.asarray(ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64),
            sum(len(d.encode("utf-8")) for d in docs))


@dataclass
class Summary:
    documents: int
    tokens: int
    bytes: int
    seconds: float
    prefix: str
    tokenizer: str
    vocab: int
    specials: dict[str, Any]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (f"{self.prefix}: {self.documents} documents, {self.tokens} tokens,"
                f" {self.bytes} bytes of text, {self.tokens_per_s:,.0f} tokens/s"
                f" ({self.tokenizer}, vocabulary {self.vocab}; {special_line(self.specials)})"
                + (f"; loss mask {self.prefix}_loss_mask: {self.specials['trained_tokens']}"
                   f" tokens train" if "trained_tokens" in self.specials else ""))


def special_line(specials: dict[str, Any]) -> str:
    """`BOS <s> (1) before each document, EOS </s> (2) after each` in words."""
    bos, eos = specials["bos"], specials["eos"]
    first = f"BOS {bos['token']} ({bos['id']}) before each document" if bos else \
        f"no BOS ({specials['bos_from']})"
    return f"{first}, EOS {eos['token']} ({eos['id']}) after each"


def prepare(inputs: list[str], tokenizer: str, out: str, *, field: str = "text",
            workers: int = 1, progress: Callable[[int, int], None] | None = None) -> Summary:
    """Tokenize `inputs` into the corpus `out` (`out.bin`, `out.idx`). `progress(documents,
    tokens)` is called after each chunk."""
    if not inputs:
        raise PrepareError("no input files")
    for path in inputs:
        if not os.path.isfile(path):
            raise PrepareError(f"{path}: no such file")
        if not path.endswith(INPUT_SUFFIXES):
            raise PrepareError(f"{path}: not .jsonl, .txt or .parquet")
    tok = load_tokenizer(tokenizer)  # in the parent too: refuse a bad one before forking
    dtype = corpus.token_dtype(tok.vocab)
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise PrepareError(f"--out {out}: folder {folder} does not exist")
    # The pool forks before megatron.core is imported (the workers need only the tokenizer).
    ctx = multiprocessing.get_context("fork")
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) \
        if workers > 1 else None
    tmp_bin, tmp_idx = corpus.bin_path(out) + ".tmp", corpus.idx_path(out) + ".tmp"
    try:
        builder_class = megatron_builder()
        t0 = time.perf_counter()  # the tokenizing and writing, not the imports
        builder = builder_class(tmp_bin, dtype=dtype)
        docs = tokens = nbytes = 0
        if pool is None:
            _init_worker(tokenizer)
            results: Iterator[tuple[np.ndarray, np.ndarray, int]] = map(
                _encode_chunk, _chunks(inputs, field))
        else:
            results = pool.imap(_encode_chunk, _chunks(inputs, field), chunksize=1)
        top, top_at, low = -1, -1, 0  # the corpus's token ids, for its PREFIX.meta.json
        for ids, lengths, size in results:
            if len(ids):
                i = int(np.argmax(ids))
                if int(ids[i]) > top:
                    top, top_at = int(ids[i]), tokens + i
                low = min(low, int(ids.min()))
            start = 0
            for length in lengths.tolist():
                builder.add_document(ids[start:start + length], [length])
                start += length
            docs += len(lengths)
            tokens += len(ids)
            nbytes += size
            if progress is not None:
                progress(docs, tokens)
        builder.finalize(tmp_idx)
        os.replace(tmp_bin, corpus.bin_path(out))
        os.replace(tmp_idx, corpus.idx_path(out))
        corpus_scan.write_meta(out, corpus_scan.Scan(
            fingerprint=corpus_scan.scan_print(out), tokens=tokens, max_token=top,
            max_at=top_at, min_token=low))
    finally:
        if pool is not None:
            pool.terminate()
        for path in (tmp_bin, tmp_idx):
            if os.path.exists(path):
                os.unlink(path)
    return Summary(documents=docs, tokens=tokens, bytes=nbytes,
                   seconds=time.perf_counter() - t0, prefix=out, tokenizer=tok.name,
                   vocab=tok.vocab, specials=tok.specials())


def inspect(prefix: str, tokenizer: str | None = None, samples: int = 3,
            chars: int = 200, data_dir: Path | None = None,
            index: bool = False) -> dict[str, Any]:
    """The header of corpus `prefix`, its counts, its largest token id, and the first
    `samples` documents decoded (with `tokenizer`) or as ids, and the special tokens the
    tokenizer has (BOS, EOS, whether it adds a BOS and why, whether it has a chat
    template). The largest id is read from the corpus's record when one describes it
    (`service.files.corpus_scan.recorded`: its `PREFIX.meta.json`, or `data_dir`'s), else
    scanned; with `index`, a scan is recorded under `data_dir`, where the controller finds it.
    `scan` says which: `meta`, `data_dir`, `scanned` or `recorded` (scanned now and
    recorded)."""
    h = corpus.read_header(prefix)
    found = corpus_scan.recorded(prefix, data_dir)
    if found is not None:
        how = "meta" if found == corpus_scan.read_meta(prefix) else "data_dir"
    else:
        found = corpus_scan.scan(prefix)
        how = "scanned"
        if index and data_dir is not None:
            corpus_scan.record(data_dir, prefix, found)
            how = "recorded"
    c = corpus.Corpus(prefix)
    tok = load_tokenizer(tokenizer) if tokenizer else None
    shown = []
    for seq in range(min(samples, len(c))):
        ids = [int(t) for t in c.get(seq)]
        shown.append({"sequence": seq, "tokens": len(ids),
                      "text": tok.decode(ids)[:chars] if tok else None,
                      "ids": None if tok else ids[:32]})
    lengths = c.lengths
    mask = prefix + "_loss_mask"
    trained = int(corpus.Corpus(mask).tokens.sum(dtype=np.int64)) \
        if os.path.exists(corpus.idx_path(mask)) else None
    return {"prefix": prefix, "magic": corpus.MAGIC.decode("latin-1"),
            "version": corpus.VERSION, "dtype": h.dtype.__name__, "sequences": h.sequences,
            "documents": h.documents, "tokens": h.tokens, "idx_bytes": h.idx_bytes,
            "bin_bytes": h.bin_bytes, "max_token": found.max_token, "scan": how,
            "mean_sequence": float(lengths.mean()) if len(c) else 0.0,
            "special_tokens": tok.specials() if tok else None, "loss_mask": mask
            if trained is not None else None, "trained_tokens": trained, "samples": shown}


def on_terminal() -> bool:
    return sys.stderr.isatty()
