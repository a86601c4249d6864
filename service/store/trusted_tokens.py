"""The tokens an API process trusts for a few seconds without asking the database again
(`Identity.authenticate`), and how a change to who may authenticate reaches every process.

A token checked less than `AUTH_CACHE_S` ago is trusted if nothing that decides it changed
since: this process's count of changes, and the stamp file (`STAMP_FILE` in the data
directory) that any process replaces when it revokes a token, disables a user or adds a
member to a project (a principal carries its user's projects); every process on the host
sees the new file on its next request (one `stat`). An expiry is checked on every request
all the same.
"""

from __future__ import annotations

import os
import time
from contextlib import suppress
from datetime import datetime
from pathlib import Path
from typing import Generic, TypeVar

from service.store.tables import utcnow

Principal = TypeVar("Principal")
"""Whom a token names (`service.store.identity.Principal`)."""

AUTH_CACHE_S = 5.0
"""How long a process trusts a token it checked without asking the database again
(`Identity.authenticate`): the longest a token revoked, or a user disabled, by another
process without a shared stamp file keeps working there."""
AUTH_CACHE_MAX = 10_000
STAMP_FILE = ".identity-changed"
"""In the data directory: replaced whenever a token is revoked, a user disabled or a member
added to a project, so that every API process on the host drops the tokens it trusted
(`Identity.changed`)."""

Generation = tuple[int, int, int]


class TrustedTokens(Generic[Principal]):
    """A process's trusted tokens (by hash), at most `AUTH_CACHE_MAX` of them."""

    def __init__(self, stamp: Path | None) -> None:
        self._stamp = stamp
        self._local = 0
        self._trusted: dict[str, tuple[float, Generation, Principal, datetime | None]] = {}

    def mark(self) -> Generation:
        """What says that nothing changed since a token was trusted: this process's count of
        changes, and the stamp file's inode and modification time."""
        if self._stamp is None:
            return self._local, 0, 0
        try:
            st = os.stat(self._stamp)
        except OSError:
            return self._local, 0, 0
        return self._local, st.st_ino, st.st_mtime_ns

    def get(self, key: str) -> Principal | None:
        """The principal of a token trusted less than `AUTH_CACHE_S` ago, unexpired, with
        nothing changed since; None: ask the database."""
        hit = self._trusted.get(key)
        if hit is None:
            return None
        when, mark, who, expires = hit
        if time.monotonic() - when < AUTH_CACHE_S and mark == self.mark() and (
                expires is None or expires > utcnow()):
            return who
        return None

    def put(self, key: str, who: Principal, expires: datetime | None,
            mark: Generation) -> None:
        """Trust `key` from now on, as of `mark` (taken before the database was read)."""
        if len(self._trusted) >= AUTH_CACHE_MAX:
            self._trusted.clear()
        self._trusted[key] = (time.monotonic(), mark, who, expires)

    def changed(self) -> None:
        """Forget every trusted token here, and tell the other processes through the stamp
        file."""
        self._local += 1
        self._trusted.clear()
        if self._stamp is not None:
            with suppress(OSError):
                tmp = self._stamp.with_name(f"{self._stamp.name}.{os.getpid()}")
                tmp.write_text(f"{os.getpid()} {time.time_ns()}\n")
                os.replace(tmp, self._stamp)  # a new inode: seen even within one mtime tick
