"""Pages of a tag's mapped files given back once read: the export maps the tag's files
(`torch.load(mmap=True)`) and reads each tensor from them; the pages it touched stay in its
resident set until the mapping goes, which for a whole model's tag is the whole model again.
Once each tensor is made (`hf_export.export`), `release` drops this process's page-table
entries of those mappings (`madvise(MADV_DONTNEED)`): the file's pages stay in the page cache,
a later read maps them again, and the resident set holds what the shard being made needs.

Only mappings that hold no page of their own are released: a private mapping's page that was
written to is anonymous memory (copy-on-write), which MADV_DONTNEED would discard, so a
mapping with any `Anonymous` bytes in `/proc/self/smaps` is left as it is.
"""

from __future__ import annotations

import ctypes
import os

MADV_DONTNEED = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def _mappings(prefix: str) -> list[tuple[int, int, int]]:
    """(start, end, anonymous kB) of this process's mappings of files under `prefix`."""
    out: list[tuple[int, int, int]] = []
    current: list[int] | None = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    current = None
                    if len(head) == 6 and head[5].rstrip("\n").startswith(prefix):
                        start, end = (int(x, 16) for x in head[0].split("-"))
                        current = [start, end, 0]
                        out.append(current)  # type: ignore[arg-type]
                elif current is not None and head[0] == "Anonymous:":
                    current[2] = int(head[1])
    except OSError:
        return []
    return [(s, e, a) for s, e, a in out]


def release(folder: str) -> int:
    """Drop the resident pages of this process's mappings of files under `folder` that hold
    no page of their own; the bytes of the ranges released."""
    prefix = os.path.realpath(folder).rstrip("/") + "/"
    released = 0
    for start, end, anonymous in _mappings(prefix):
        if anonymous == 0 and _libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            released += end - start
    return released
