"""Bad data is refused before it trains: the corpora of a spec checked at submission, and again
by the ranks before they read them.

At submission (`service.submission.intake.submit`, after `service.submission.confine` kept the
paths inside the data roots) the `.idx` of every corpus of `data.train` and `data.valid` is read
(`service.files.corpus.read_header`: its fixed header alone when a record of the files gives
their token count, every array otherwise; the `.bin` is only `stat`ed): a missing file, a wrong
magic or version, counts that disagree with the `.idx`'s or the `.bin`'s size, or fewer tokens
than one global batch needs (`global_batch * seq_len + 1`, in the training and the held-out
part of each corpus alike) is a SpecError on `data.train.<i>.path` (or `data.valid.<i>.path`)
naming the file and the reason. So is a token id at or above `model.vocab` when the corpus's
largest token id is known already (`service.files.corpus_scan.recorded`: its
`PREFIX.meta.json`, or the data directory's record of an earlier scan), or when its `.bin` is
small enough to scan here (`corpus_scan.INLINE_BYTES`). A larger corpus never scanned is
accepted: the controller scans it before it admits the job, and fails the job with the same
reason when a token id is out of the vocabulary (`service.control.corpus_admission`).

What a submission costs the API follows its spec, not its corpora: the files are read in
bounded chunks (`service.files.corpus`), each distinct corpus once however often it is listed, and
at most `TRIDENT_DATA_CHECKS` checks run at once on the server, `TRIDENT_DATA_CHECKS_PER_USER`
of them for one user (`CheckSlots`: lock files every API process shares); a submission that
finds no slot within `TRIDENT_DATA_CHECK_WAIT_S` is refused (`ChecksBusy`: a 429 or a 503).

The stored spec then carries each corpus's `fingerprint` (size, modification time, inode and
status-change time of both files, as they resolve): rank 0, before it reads them, resolves
the paths against the data roots again and compares the fingerprint (`workers.trainer.data`), and
every rank compares the `.bin` it opened (`workers.trainer.sample_order`), so that a file replaced
since (by a symlink to a file outside the roots with the same size and modification time
included: its inode and status-change time differ) fails the job saying which file changed,
rather than train on a corpus nobody checked. The controller does not retry such an attempt
(`changed_corpus`).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from service.contract.spec import CorpusRef, JobSpec, SpecError
from service.files import corpus, corpus_scan
from service.files.datadir import try_lock


def file_print(ext: str, st: os.stat_result) -> str:
    """`<ext>:<bytes>:<mtime_ns>:<inode>:<ctime_ns>` of one file of a corpus: the status-change
    time cannot be set back by its owner, so a file replaced by another of the same size and
    modification time still differs."""
    return f"{ext}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"


def fingerprint(prefix: str) -> str:
    """`file_print` of corpus `prefix`'s `.idx`, then of its `.bin`, comma-separated (through
    symlinks: of the files read)."""
    return ",".join(file_print(ext, os.stat(f"{prefix}.{ext}")) for ext in ("idx", "bin"))


def _comparable(now: str, then: str) -> str:
    """`now` cut to the fields `then` has (a spec stored before the fingerprint had inodes
    and status-change times carries sizes and modification times only)."""
    fields = [len(p.split(":")) for p in then.split(",")]
    return ",".join(":".join(p.split(":")[:n]) for p, n in zip(now.split(","), fields,
                                                                 strict=False))


def changed(ref: CorpusRef) -> str | None:
    """Why corpus `ref` is not the one checked at submission; None when it is (or was never
    fingerprinted)."""
    if ref.fingerprint is None:
        return None
    try:
        now = fingerprint(ref.path)
    except OSError as exc:
        return f"{ref.path}: {exc.strerror} since the job was submitted"
    return _differs(ref.path, ref.fingerprint, _comparable(now, ref.fingerprint))


def opened_changed(prefix: str, fp: str | None, opened: os.stat_result) -> str | None:
    """Why the `.bin` a rank opened (its `fstat`) is not the one of corpus `prefix`'s
    fingerprint `fp` (None: not fingerprinted)."""
    if fp is None:
        return None
    then = fp.split(",")[-1]
    return _differs(prefix, then, _comparable(file_print("bin", opened), then))


def _differs(prefix: str, then: str, now: str) -> str | None:
    if now == then:
        return None
    return (f"{prefix}: the corpus changed after the job was submitted (was {then}, now"
            f" {now}); resubmit to check it again")


def changed_corpus(spec: JobSpec) -> str | None:
    """Why one of `spec`'s corpora is not the one checked at submission (the first; None when
    none changed): the controller does not retry an attempt that failed on it."""
    for ref in [*spec.data.train, *spec.data.valid]:
        if why := changed(ref):
            return why
    return None


def split_tokens(header: corpus.Header, valid_fraction: float) -> tuple[int, int]:
    """Tokens of the training part and of the held-out part of the corpus `header` (its last
    `held_out(documents, valid_fraction)` documents), the lengths read in chunks."""
    total = header.tokens
    held = held_out(header.documents, valid_fraction)
    if not held:
        return total, 0
    valid = corpus.tokens_from(header, corpus.boundary(header, header.documents - held))
    return total - valid, valid


def held_out(documents: int, fraction: float) -> int:
    """How many of a corpus's last documents `valid_fraction` holds out (at least one when the
    fraction is not 0)."""
    if not fraction or not documents:
        return 0
    return max(1, int(documents * fraction))


@dataclass(frozen=True)
class CheckSlots:
    """How many corpus checks run at once: `total` on the server (across its API processes:
    each slot is a lock file in `folder`, held while a check runs), `per_user` of them for one
    user; a submission that finds none free within `wait_s` is refused (ChecksBusy)."""

    folder: Path
    total: int
    per_user: int
    wait_s: float

    @contextmanager
    def held(self, user: str) -> Iterator[None]:
        """A slot of `user`'s, then one of the server's, held inside the block."""
        deadline = time.monotonic() + self.wait_s
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        tag = hashlib.sha256(user.encode()).hexdigest()[:16]
        with self._slot(f"user-{tag}", self.per_user, deadline,
                        ChecksBusy(429, f"{user} has {self.per_user} corpus check(s) under way"
                                   f" already (TRIDENT_DATA_CHECKS_PER_USER), for"
                                   f" {self.wait_s:g} s (TRIDENT_DATA_CHECK_WAIT_S); submit"
                                   " again when one has ended")), \
                self._slot("server", self.total, deadline,
                           ChecksBusy(503, f"the server runs {self.total} corpus check(s)"
                                      " already (TRIDENT_DATA_CHECKS), and none ended within"
                                      f" {self.wait_s:g} s (TRIDENT_DATA_CHECK_WAIT_S); submit"
                                      " again later")):
            yield

    @contextmanager
    def _slot(self, name: str, count: int, deadline: float, busy: ChecksBusy) -> Iterator[None]:
        """One of the `count` lock files `name-<i>` locked (flock: released by the kernel when
        the process ends), polling until `deadline`; `busy` raised after it."""
        while True:
            for i in range(count):
                fd = try_lock(self.folder / f"{name}-{i}.lock")
                if fd is None:
                    continue
                try:
                    yield
                    return
                finally:
                    os.close(fd)  # the lock goes with its last descriptor
            if time.monotonic() >= deadline:
                raise busy
            time.sleep(SLOT_POLL_S)


CHECK_SLOTS = "data-check-slots"
"""The folder of the check slots' lock files, in the data directory."""
SLOT_POLL_S = 0.05
"""How often a submission waiting for a check slot tries the slots again."""


class ChecksBusy(Exception):
    """No corpus check slot was free in time: `status` 429 (the user's own are taken) or 503
    (the server's are), and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_data(spec: JobSpec, slots: CheckSlots | None = None, user: str = "",
               data_dir: Path | None = None) -> JobSpec:
    """SpecError naming the first corpus of `spec` that cannot be trained on and why; else the
    spec with every corpus's fingerprint. Each distinct corpus (by the real paths of its
    files) is checked once however often it is listed; with `slots`, inside one of `user`'s
    and the server's check slots (ChecksBusy when none is free in time). With `data_dir` (the
    server's), a `.bin` is read only when it is at most `corpus_scan.INLINE_BYTES` and no record
    says what it holds (the scan is recorded there); without it (a caller with no server) every
    corpus with no record is scanned here."""
    data = spec.data
    if not data.corpora:
        return spec
    with slots.held(user) if slots is not None else nullcontext():
        return _checked(spec, data_dir)


def read_checked(prefix: str, vocab: int, data_dir: Path | None) -> corpus.Header:
    """The header of corpus `prefix` (`corpus.read_header`: its arrays read only when no record
    of the files gives their token count), after `check_tokens`."""
    try:
        found = corpus_scan.recorded(prefix, data_dir)
    except OSError:  # a file missing: read_header says which
        found = None
    header = corpus.read_header(prefix, found.tokens if found is not None else None)
    check_tokens(header, vocab, data_dir, found)
    return header


def check_tokens(header: corpus.Header, vocab: int, data_dir: Path | None,
                 found: corpus_scan.Scan | None = None) -> None:
    """CorpusError when corpus `header` holds a token id outside `vocab`, as far as is known
    without a scan of a large `.bin` (see `check_data`); `found`: its record, looked up
    already."""
    prefix = header.prefix
    if not corpus_scan.needs_scan(header, vocab):
        return
    if found is None:
        found = corpus_scan.recorded(prefix, data_dir)
    if found is None and (data_dir is None or header.bin_bytes <= corpus_scan.INLINE_BYTES):
        found = corpus_scan.scan_once(prefix, data_dir)
    if found is not None and (why := found.refusal(vocab)):
        raise corpus.CorpusError(corpus.bin_path(prefix), why)


def check_mask(header: corpus.Header) -> None:
    """CorpusError when the loss mask of chat corpus `header` (`PREFIX_loss_mask.bin/.idx`,
    `trident data prepare --chat`) is missing or does not hold the same sequences."""
    from service.files.chat_prepare import mask_prefix
    prefix = mask_prefix(header.prefix)
    try:
        mask = corpus.read_header(prefix)
    except corpus.CorpusError as exc:
        raise corpus.CorpusError(exc.file, "kind 'chat' needs the loss mask beside the corpus"
                                 f" (trident data prepare --chat writes it): {exc.reason}"
                                 ) from None
    if (mask.sequences, mask.documents, mask.tokens) != \
            (header.sequences, header.documents, header.tokens):
        raise corpus.CorpusError(corpus.idx_path(prefix), f"the loss mask holds {mask.sequences}"
                                 f" sequences, {mask.documents} documents, {mask.tokens} tokens;"
                                 f" the corpus {header.sequences}, {header.documents},"
                                 f" {header.tokens}: not the same documents")


def _checked(spec: JobSpec, data_dir: Path | None) -> JobSpec:
    data = spec.data
    need = spec.train.global_batch * spec.planned_model.seq_len + 1
    checked: dict[tuple[str, str], tuple[corpus.Header, str]] = {}
    out: dict[str, list[CorpusRef]] = {}
    for name in ("train", "valid"):
        refs = []
        for i, ref in enumerate(getattr(data, name)):
            field = f"data.{name}.{i}.path"
            key = (os.path.realpath(corpus.idx_path(ref.path)),
                   os.path.realpath(corpus.bin_path(ref.path)))
            if key in checked:  # the same files, listed again: read once
                refs.append(ref.model_copy(update={"fingerprint": checked[key][1]}))
                continue
            try:
                header = read_checked(ref.path, spec.planned_model.vocab, data_dir)
                fp = fingerprint(ref.path)
                if data.kind == "chat":
                    check_mask(header)
            except corpus.CorpusError as exc:
                raise SpecError(field, str(exc)) from None
            except OSError as exc:
                raise SpecError(field, f"{ref.path}: {exc.strerror}") from None
            parts = [("it holds", header.tokens)]
            if name == "train" and data.valid_fraction:
                try:
                    train_part, valid_part = split_tokens(header, data.valid_fraction)
                except corpus.CorpusError as exc:
                    raise SpecError(field, str(exc)) from None
                parts = [("its training part holds", train_part),
                         (f"its held-out part (valid_fraction {data.valid_fraction:g}) holds",
                          valid_part)]
            for what, tokens in parts:
                if tokens < need:
                    raise SpecError(field, f"{corpus.bin_path(ref.path)}: too few tokens:"
                                    f" {what} {tokens}, one global batch needs"
                                    f" train.global_batch({spec.train.global_batch}) *"
                                    f" model.seq_len({spec.planned_model.seq_len}) + 1 = {need}")
            checked[key] = (header, fp)
            refs.append(ref.model_copy(update={"fingerprint": fp}))
        out[name] = refs
    return spec.model_copy(update={"data": data.model_copy(update=out)})
