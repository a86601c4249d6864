"""Test helper: corpora written in the published layout of Megatron's indexed dataset, without
megatron-core (tests/test_corpus.py proves the layout against megatron-core's own builder and
reader)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np


def write_corpus(prefix: Path, docs: list[list[int]], dtype: Any = np.uint16) -> None:
    """A corpus in the published layout of Megatron's indexed dataset (tests/test_corpus.py
    proves it against megatron-core's own builder and reader)."""
    code = {np.uint16: 8, np.int32: 4}[dtype]
    size = np.dtype(dtype).itemsize
    lengths = np.array([len(d) for d in docs], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * size)])
    bounds = np.arange(len(docs) + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(docs), len(docs) + 1))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + bounds.tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        for d in docs:
            f.write(np.array(d, dtype).tobytes())
