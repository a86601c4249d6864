"""The sample-order cache: where the ranks keep the index of a job's global sample order
(`workers.trainer.sample_order`), and how much of the disk it may take.

It is one folder under the server's data directory (`<data_dir>/sample-orders/`, never beside
a corpus: corpus folders need not be writable), with one entry per order, named by the hash
of everything the order depends on (the corpora's paths and fingerprints, the seed, seq_len,
the sample count, the weights, the split). A job whose order is there already (another job
with the same corpora, seed, seq_len and steps, a resubmission, a retry) reads it instead of
building it again.

Its bytes are bounded twice, both settings (`Settings.order_cache_user_bytes`,
`Settings.order_cache_bytes`):

- per user: the entries a user's jobs built or read count against that user's bound. Making
  room for a new one first forgets that user's least recently used entries that no running
  job reads; a job whose order would still pass the bound is refused, at submission when its
  order alone is bigger than the bound (`min_bytes`: what any order of that many samples takes
  at least), else by the rank that builds it (`CacheRefused`), with one line naming the bound;
- in all: past the total bound, the least recently used entries that no running job reads are
  deleted before a new one is written; when that cannot make room the build is refused too.

Every rank that reads an entry holds a shared `flock` on its `lock` file (whose modification
time is its last use) for as long as it reads it; an entry is deleted only under an exclusive
one, so never while a job reads it. The decisions are taken under an exclusive `flock` on the
cache's own `.lock`, so that concurrent builders count the same bytes.

Called by `workers.trainer.sample_order` (on the ranks: pure Python, no database) and at submission
by `service.submission.confine` (`min_bytes`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FOLDER = "sample-orders"
"""The cache's folder under the data directory."""
ENTRY = "entry.json"
"""An entry's record: its bytes and the users whose jobs built or read it."""
LOCK = "lock"
"""An entry's lock file: shared while a rank reads the entry; its mtime is its last use."""
MIN_BYTES_PER_SAMPLE = 26
"""What every global sample costs an order at least (`workers.trainer.sample_order`): its corpus
(int16), window (int64), first offset (int32), start of its pieces (int64) and one piece
(int32)."""
BLOCK = 4096
"""What a file takes on disk at least, and the unit it grows by (a filesystem's block)."""
NPY_HEADER = 128
"""The most bytes `numpy.save` writes before an array of one dimension."""
SMALL_FILES = 3
"""An entry's files beside its arrays: the order's record, the lock and the entry's record,
a block each."""


class CacheRefused(Exception):
    """An order that the cache's bounds leave no room for: one line naming the bound."""


def size_text(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def min_bytes(samples: int) -> int:
    """The fewest bytes an order of `samples` global samples takes in the cache."""
    return samples * MIN_BYTES_PER_SAMPLE if samples else 0


def user_refusal(samples: int, user_bytes: int) -> str | None:
    """Why a job whose orders hold `samples` samples in all cannot fit a user's bound, computed
    without building them; None when it may (the rank checks the exact size again)."""
    need = min_bytes(samples)
    if need <= user_bytes:
        return None
    return (f"its sample order ({samples} samples) needs at least {size_text(need)} of the"
            f" sample-order cache, more than the per-user bound"
            f" TRIDENT_ORDER_CACHE_USER_BYTES ({size_text(user_bytes)})")


@dataclass(frozen=True)
class OrderCache:
    """The cache's folder and bounds, as the controller's launcher sends them to the ranks."""

    root: Path
    user_bytes: int
    total_bytes: int

    @classmethod
    def of(cls, data_dir: Path, user_bytes: int, total_bytes: int) -> OrderCache:
        return cls(Path(data_dir) / FOLDER, user_bytes, total_bytes)

    def to_json(self) -> dict[str, Any]:
        return {"root": str(self.root), "user_bytes": self.user_bytes,
                "total_bytes": self.total_bytes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OrderCache:
        return cls(Path(data["root"]), int(data["user_bytes"]), int(data["total_bytes"]))

    def folder(self, key: str) -> Path:
        return self.root / key

    # --- reading ------------------------------------------------------------------------------

    def pin(self, key: str) -> int:
        """Mark entry `key` read now (its last use) and hold it against deletion until the
        returned descriptor is closed. FileNotFoundError when it is not there."""
        path = self.folder(key) / LOCK
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        if not os.path.exists(path):  # deleted between the open and the lock
            os.close(fd)
            raise FileNotFoundError(errno.ENOENT, "the sample order was deleted", str(path))
        with contextlib.suppress(OSError):
            os.utime(path)
        return fd

    # --- building -----------------------------------------------------------------------------

    def reuse(self, key: str, user: str) -> int | None:
        """Entry `key` pinned (`pin`) for `user`'s job when some job built it already, counted
        against `user`'s bound from now on (CacheRefused when it does not fit); None when it
        is not there."""
        if not self.root.is_dir():
            return None
        with self._locked():
            entries = self._entries()
            return self._pinned(entries, key, user) if key in entries else None

    def admit(self, key: str, user: str, arrays: list[int],
              write: Callable[[Path], None]) -> int:
        """Entry `key` for `user`'s job, pinned (`pin`): written by `write(folder)` once the
        bounds leave room for arrays of `arrays` bytes each (`disk_bytes`), or read as it is
        when another job wrote it meanwhile. CacheRefused when they do not; it counts against
        `user`'s bound from now on."""
        os.makedirs(self.root, exist_ok=True)
        with self._locked():
            entries = self._entries()
            if key in entries:
                return self._pinned(entries, key, user)
            need = disk_bytes(arrays)
            self._room_for_user(entries, user, need, key)
            self._room_in_all(entries, need, key)
            self._write(key, user, write)
            return self.pin(key)

    def _pinned(self, entries: dict[str, _Entry], key: str, user: str) -> int:
        have = entries[key]
        if user not in have.users:
            self._room_for_user(entries, user, have.bytes, key)
            self._record(key, have.bytes, [*have.users, user])
        return self.pin(key)

    def _room_for_user(self, entries: dict[str, _Entry], user: str, need: int,
                       key: str) -> None:
        mine = [e for k, e in entries.items() if user in e.users and k != key]
        held = sum(e.bytes for e in mine)
        for entry in sorted(mine, key=lambda e: e.used):
            if held + need <= self.user_bytes:
                break
            if self._forget(entry, user):
                held -= entry.bytes
        if held + need > self.user_bytes:
            raise CacheRefused(
                f"the sample order needs {size_text(need)} of the sample-order cache; with the"
                f" {size_text(held)} that {user}'s running jobs read, that passes the per-user"
                f" bound TRIDENT_ORDER_CACHE_USER_BYTES ({size_text(self.user_bytes)})")

    def _room_in_all(self, entries: dict[str, _Entry], need: int, key: str) -> None:
        others = [e for k, e in entries.items() if k != key]
        held = sum(e.bytes for e in others if e.users)
        for entry in sorted(others, key=lambda e: e.used):
            if held + need <= self.total_bytes:
                break
            if entry.users and self._forget(entry, None):
                held -= entry.bytes
        if held + need > self.total_bytes:
            raise CacheRefused(
                f"the sample order needs {size_text(need)} of the sample-order cache; the"
                f" running jobs' orders hold {size_text(held)}, and that passes the cache's"
                f" bound TRIDENT_ORDER_CACHE_BYTES ({size_text(self.total_bytes)})")

    def _forget(self, entry: _Entry, user: str | None) -> bool:
        """Take `entry` off `user`'s count (None: everyone's), deleting it when nobody's count
        keeps it; False when a running job reads it."""
        with self._exclusive(entry.key) as free:
            if not free:
                return False
            users = [u for u in entry.users if user is not None and u != user]
            if users:
                self._record(entry.key, entry.bytes, users)
            else:
                shutil.rmtree(self.folder(entry.key), ignore_errors=True)
            entry.users = users
            return True

    def _write(self, key: str, user: str, write: Callable[[Path], None]) -> None:
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=self.root))
        try:
            write(tmp)
            (tmp / LOCK).touch()
            os.rename(tmp, self.folder(key))
        finally:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
        self._record(key, 0, [user])  # the record's own bytes count too
        self._record(key, entry_bytes(self.folder(key)), [user])

    def _record(self, key: str, size: int, users: list[str]) -> None:
        path = self.folder(key) / ENTRY
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"bytes": size, "users": sorted(set(users))}))
        os.replace(tmp, path)

    # --- what the cache holds -----------------------------------------------------------------

    def _entries(self) -> dict[str, _Entry]:
        """Every complete entry; an entry without its record (a build that died between its
        rename and its record) is deleted."""
        out = {}
        for name in sorted(os.listdir(self.root)):
            folder = self.folder(name)
            if name.startswith(".") or not folder.is_dir():
                continue
            try:
                record = json.loads((folder / ENTRY).read_text())
                used = os.stat(folder / LOCK).st_mtime
            except (OSError, ValueError):
                with self._exclusive(name) as free:
                    if free:
                        shutil.rmtree(folder, ignore_errors=True)
                continue
            out[name] = _Entry(name, int(record["bytes"]), list(record["users"]), used)
        return out

    def held(self, user: str | None = None) -> int:
        """Bytes of the entries counted against `user` (None: all of them)."""
        if not self.root.is_dir():
            return 0
        with self._locked():
            return sum(e.bytes for e in self._entries().values()
                       if e.users and (user is None or user in e.users))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _exclusive(self, key: str) -> Iterator[bool]:
        """Whether no rank reads entry `key` (held exclusively meanwhile)."""
        try:
            fd = os.open(self.folder(key) / LOCK, os.O_RDONLY)
        except FileNotFoundError:
            yield True
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)


@dataclass(frozen=True)
class ServerData:
    """What a job's ranks are told of the server's data rules: the sample-order cache, and the
    data roots every corpus must lie inside (`Settings.data_root_dirs`), checked again by
    rank 0 before it reads (`workers.trainer.data`)."""

    orders: OrderCache
    data_roots: tuple[str, ...]

    @classmethod
    def of(cls, settings: Any) -> ServerData:
        """From the server's `service.settings.Settings`."""
        orders = OrderCache.of(settings.data_dir, settings.order_cache_user_bytes,
                               settings.order_cache_bytes)
        return cls(orders, tuple(str(r) for r in settings.data_root_dirs))

    @classmethod
    def from_settings(cls) -> ServerData:
        """From this environment's `TRIDENT_*` settings (a rank started without a controller:
        torchrun, benches)."""
        from service.settings import Settings

        return cls.of(Settings())

    def to_json(self) -> dict[str, Any]:
        return {"orders": self.orders.to_json(), "data_roots": list(self.data_roots)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServerData:
        return cls(OrderCache.from_json(data["orders"]), tuple(data["data_roots"]))


@dataclass
class _Entry:
    key: str
    bytes: int
    users: list[str]
    used: float


def disk_bytes(arrays: list[int]) -> int:
    """What an entry whose arrays hold `arrays` bytes each takes on disk, at most (the files
    in whole blocks)."""
    whole = [-(-(n + NPY_HEADER) // BLOCK) * BLOCK for n in arrays]
    return sum(whole) + SMALL_FILES * BLOCK


def entry_bytes(folder: Path) -> int:
    """The bytes of the files in `folder`, as the disk holds them (allocated blocks, or the
    apparent size where that is larger)."""
    total = 0
    for path in folder.iterdir():
        st = path.stat()
        total += max(st.st_size, st.st_blocks * 512)
    return total
