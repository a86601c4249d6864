"""Reading a file that a spec names (a Hugging Face `config.json`, a checkpoint folder's
record): regular files only, and at most a bounded number of bytes.

Called by `service.contract.hf_config` (the submission's `model.hf_config`) and
`service.files.checkpoint_dirs.read_writer` (the records `checkpoint.dir` and `init.from_hf` are
checked against). A FIFO, a socket or a device is refused before it is opened for reading: opening a
FIFO waits for a writer, and a read of one waits for its data, forever. The API also reads
these files off its event loop and within a time limit (`api.deps.read_hf_configs`), which
this module cannot give: a hung network mount hangs `stat` itself.
"""

from __future__ import annotations

import os
import stat


class FileRefused(ValueError):
    """A file that is not read, and why (the message names the path)."""


def kind(mode: int) -> str | None:
    """What a file of `mode` is when it is not a regular file (`a FIFO`, ...); None when it is
    one."""
    if stat.S_ISREG(mode):
        return None
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str) -> int:
    """A read-only descriptor of `path` (symlinks followed), when it is a regular file;
    FileRefused naming what it is otherwise, OSError when it cannot be opened. Checked before
    the open (a device is never opened) and again on the open file (a FIFO swapped in between
    is opened without waiting for a writer: O_NONBLOCK)."""
    if what := kind(os.stat(path).st_mode):
        raise FileRefused(f"{path}: {what}, not a regular file; only regular files are read")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if what := kind(os.fstat(fd).st_mode):
            raise FileRefused(f"{path}: {what}, not a regular file; only regular files are"
                              " read")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, max_bytes: int, limit_name: str = "") -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them: FileRefused when it
    is not a regular file or is larger (naming `limit_name`, the setting of the bound, when
    given); OSError when it cannot be read."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        setting = f" ({limit_name})" if limit_name else ""
        if size > max_bytes:
            raise FileRefused(f"{path}: {size} bytes, larger than the {max_bytes} read"
                              f"{setting}")
        chunks, got = [], 0
        while got <= max_bytes and (chunk := os.read(fd, max_bytes + 1 - got)):
            chunks.append(chunk)
            got += len(chunk)
        raw = b"".join(chunks)
        if len(raw) > max_bytes:  # grew since the fstat
            raise FileRefused(f"{path}: larger than the {max_bytes} bytes read{setting}")
        return raw
    finally:
        os.close(fd)
