"""What a corpus's tokens hold (its largest and smallest token id, its token count), known
without reading its `.bin` in a request.

Checking a corpus against `model.vocab` needs its largest token id, and finding that reads the
whole `.bin` (minutes on a 100 GB corpus). So it is read once, never inside an HTTP request for
a corpus of any size, and the result kept:

- `trident data prepare` writes it while it writes the corpus, in `PREFIX.meta.json` beside the
  `.idx` (`write_meta`);
- a corpus without one (prepared by Megatron's own `preprocess_data.py`, or copied without it)
  is scanned once by the controller before the job that names it is admitted
  (`service.control.corpus_admission`), or by `trident data inspect --index`; the result is
  kept under the server's data directory, in `<data_dir>/corpus-scans/` (`record`), so corpus
  folders may be read-only;
- a `.bin` of at most `INLINE_BYTES` is scanned at submission itself (a bounded cost, like
  reading its `.idx`), and recorded the same way.

Both records carry the `fingerprint` they describe: the size and modification time (in
nanoseconds) of the `.idx` and of the `.bin`, as they resolve through symlinks
(`scan_print`). Two `stat` calls, whatever the corpus's size: a hash of the `.idx` would cost a
read of the whole index (hundreds of MB for a 100 GB corpus) in every request, and would not
change when the `.bin` is rewritten with other tokens of the same lengths. A rewrite of either
file changes its modification time, so a record of another version is never used; a copy that
keeps the times (`cp -p`, `rsync -t`) keeps its `PREFIX.meta.json` valid. The inode and
status-change time, which the submitted spec's own fingerprint adds
(`service.files.data_check.fingerprint`), are left out here for that reason: the spec's
fingerprint stops a file swapped after submission; this one says which tokens were counted.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from service.contract.specfiles import FileRefused, open_regular
from service.files import corpus

META_SUFFIX = ".meta.json"
"""`PREFIX.meta.json`: the record `trident data prepare` writes beside `PREFIX.idx`."""
FOLDER = "corpus-scans"
"""The records of scanned corpora, under the data directory."""
INLINE_BYTES = 64 << 20
"""A `.bin` up to this size (64 MiB) is scanned at submission when no record describes it:
at most a few tens of milliseconds, as bounded as reading its `.idx`."""
META_MAX_BYTES = 64 << 10
"""The most bytes read of one record (real ones are a few hundred)."""
FORMAT = 1


@dataclass(frozen=True)
class Scan:
    """What corpus tokens hold, and the fingerprint (`scan_print`) of the files counted."""

    fingerprint: str
    tokens: int
    max_token: int
    """-1 when the corpus holds no token."""
    max_at: int
    """The first token (counted from 0) holding `max_token` (-1 when the corpus holds none)."""
    min_token: int
    """0 when the corpus holds no token."""

    def refusal(self, vocab: int) -> str | None:
        """Why these tokens cannot train a model of `vocab` ids (None: they can); the
        reason alone, without the file (`corpus.CorpusError` adds it)."""
        if self.max_token >= vocab:
            return (f"token id {self.max_token} (first at token {self.max_at}) is at or above"
                    f" the model's vocabulary model.vocab({vocab})")
        if self.min_token < 0:
            return f"token id {self.min_token} is negative"
        return None

    def to_json(self) -> dict[str, object]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: object) -> Scan | None:
        """The record `data`; None when it is not one of this format."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return None
        try:
            return cls(fingerprint=str(data["fingerprint"]), tokens=int(data["tokens"]),
                       max_token=int(data["max_token"]), max_at=int(data["max_at"]),
                       min_token=int(data["min_token"]))
        except (KeyError, TypeError, ValueError):
            return None


def scan_print(prefix: str) -> str:
    """`idx:<bytes>:<mtime_ns>,bin:<bytes>:<mtime_ns>` of corpus `prefix` (through symlinks).
    OSError when a file is missing."""
    out = []
    for ext in ("idx", "bin"):
        st = os.stat(f"{prefix}.{ext}")
        out.append(f"{ext}:{st.st_size}:{st.st_mtime_ns}")
    return ",".join(out)


def meta_path(prefix: str) -> str:
    return prefix + META_SUFFIX


def needs_scan(header: corpus.Header, vocab: int) -> bool:
    """Whether corpus `header`'s token ids must be read to know they fit `vocab`: not when its
    dtype is unsigned and holds no id as large (uint8 under 256 ids, uint16 under 65536)."""
    top = {1: 255, 8: 65535}.get(header.dtype_code)
    return top is None or top >= vocab


def scan(prefix: str, stop: threading.Event | None = None) -> Scan:
    """Read corpus `prefix`'s `.bin` (in chunks: memory stays bounded) for its token ids.
    CorpusError when a file is not a corpus, when it changed while being read, or when `stop`
    was set (checked between chunks: a controller that stops does not wait for a scan)."""
    before = _print_or_error(prefix)
    header = corpus.read_header(prefix)
    top, at, low = -1, -1, 0
    for start, chunk in corpus.bin_chunks(header):
        if stop is not None and stop.is_set():
            raise corpus.CorpusError(corpus.bin_path(prefix), "the scan was stopped")
        i = int(chunk.argmax())
        if int(chunk[i]) > top:
            top, at = int(chunk[i]), start + i
        low = min(low, int(chunk.min()))
    if _print_or_error(prefix) != before:
        raise corpus.CorpusError(corpus.bin_path(prefix), "changed while it was being scanned")
    return Scan(fingerprint=before, tokens=header.tokens, max_token=top, max_at=at,
                min_token=low)


def _print_or_error(prefix: str) -> str:
    try:
        return scan_print(prefix)
    except OSError as exc:
        raise corpus.CorpusError(exc.filename or prefix, exc.strerror or str(exc)) from None


def write_meta(prefix: str, found: Scan) -> None:
    """`PREFIX.meta.json` written (atomically: a reader sees the old record or the new)."""
    _write(Path(meta_path(prefix)), found)


def read_meta(prefix: str) -> Scan | None:
    """`PREFIX.meta.json` as it says, whichever files it describes (None: none, or not one)."""
    return _read(Path(meta_path(prefix)))


def cache_file(data_dir: Path, prefix: str, fingerprint: str) -> Path:
    """Where the data directory keeps the scan of corpus `prefix` at `fingerprint`: named by
    the hash of the files' real paths and the fingerprint."""
    key = "\0".join([os.path.realpath(corpus.idx_path(prefix)),
                     os.path.realpath(corpus.bin_path(prefix)), fingerprint])
    return Path(data_dir) / FOLDER / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def record(data_dir: Path, prefix: str, found: Scan) -> Path:
    """Keep `found` under `data_dir` for corpus `prefix`; the file written."""
    path = cache_file(data_dir, prefix, found.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, found)
    return path


def recorded(prefix: str, data_dir: Path | None) -> Scan | None:
    """The scan of corpus `prefix` as its files are now: its `PREFIX.meta.json` when that
    describes them, else the data directory's record of them; None when neither does.
    Reads two `stat`s and at most two small files, never the `.bin`. OSError when a file of
    the corpus is missing."""
    now = scan_print(prefix)
    places = [Path(meta_path(prefix))]
    if data_dir is not None:
        places.append(cache_file(data_dir, prefix, now))
    for place in places:
        found = _read(place)
        if found is not None and found.fingerprint == now:
            return found
    return None


def scan_once(prefix: str, data_dir: Path | None, stop: threading.Event | None = None) -> Scan:
    """`recorded`, else `scan` (and `record` it when there is a data directory)."""
    found = recorded(prefix, data_dir)
    if found is None:
        found = scan(prefix, stop)
        if data_dir is not None:
            record(data_dir, prefix, found)
    return found


def _read(path: Path) -> Scan | None:
    try:
        fd = open_regular(str(path))
    except (FileRefused, OSError):
        return None
    try:
        raw = os.read(fd, META_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > META_MAX_BYTES:
        return None
    try:
        return Scan.from_json(json.loads(raw))
    except ValueError:
        return None


def _write(path: Path, found: Scan) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(found.to_json(), f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
