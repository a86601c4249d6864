"""A finished export's folder downloaded file by file (`TridentClient.download_export`):
each file one streaming GET (`GET /jobs/{id}/exports/{export_id}/files/{name}`), written in
pieces as it arrives into a hidden folder beside the destination, its size checked against
the listing, and the folder renamed once every file is whole: never the whole model in
memory, never a tar."""

from __future__ import annotations

import errno
import os
import shutil
from typing import Any

import httpx

CHUNK = 1 << 20
"""Bytes written at a time."""


def check(out: str | os.PathLike[str]) -> tuple[str, str]:
    """The absolute destination and its parent folder (made if missing); FileExistsError
    when the destination exists, NotADirectoryError naming the file on the way."""
    target = os.path.abspath(os.fspath(out))
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, "exists already; give a new folder", target)
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
    except FileExistsError:  # a file on the way
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), parent) from None
    return target, parent


def prepare(out: str | os.PathLike[str]) -> tuple[str, str]:
    """The absolute destination (`check`) and a new hidden folder beside it to write into."""
    target, parent = check(out)
    work = os.path.join(parent, f".{os.path.basename(target)}.partial")
    shutil.rmtree(work, ignore_errors=True)
    os.mkdir(work)
    return target, work


def fetch(http: httpx.Client, path: str, dest: str, size: int, refuse: Any) -> None:
    """GET `path` streamed into the file `dest`; `refuse(response)` is raised for a 4xx/5xx,
    OSError when fewer or more than `size` bytes came."""
    with http.stream("GET", path, timeout=httpx.Timeout(30, read=300)) as resp:
        if resp.status_code >= 400:
            resp.read()
            raise refuse(resp)
        got = 0
        with open(dest, "wb") as f:
            for piece in resp.iter_bytes(CHUNK):
                f.write(piece)
                got += len(piece)
    if got != size:
        raise OSError(errno.EIO, f"{got} bytes came, the listing said {size}", dest)


def finish(work: str, target: str) -> str:
    os.replace(work, target)
    return target
