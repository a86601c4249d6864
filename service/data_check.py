"""Bad data is refused before it trains: the corpora of a spec checked at submission, and again
by the ranks before they read them.

At submission (`service.jobs.submit`, after `service.confine` kept the paths inside the data
roots) every corpus of `data.train` and `data.valid` is read (`service.corpus.check`): a
missing file, a wrong magic or version, counts that disagree with the `.idx`'s or the `.bin`'s
size, a token id at or above `model.vocab`, or fewer tokens than one global batch needs
(`global_batch * seq_len + 1`, in the training and the held-out part of each corpus alike) is
a SpecError on `data.train.<i>.path` (or `data.valid.<i>.path`) naming the file and the reason.

The stored spec then carries each corpus's `fingerprint` (sizes and modification times of
both files): a rank that finds another fingerprint before it builds its sample order
(`workers.data`) fails the job saying which file changed, rather than train on a corpus nobody
checked.
"""

from __future__ import annotations

import os

import numpy as np

from service import corpus
from service.spec import CorpusRef, JobSpec, SpecError


def fingerprint(prefix: str) -> str:
    """`idx:<bytes>:<mtime_ns>,bin:<bytes>:<mtime_ns>` of corpus `prefix`."""
    parts = []
    for ext in ("idx", "bin"):
        st = os.stat(f"{prefix}.{ext}")
        parts.append(f"{ext}:{st.st_size}:{st.st_mtime_ns}")
    return ",".join(parts)


def changed(ref: CorpusRef) -> str | None:
    """Why corpus `ref` is not the one checked at submission; None when it is (or was never
    fingerprinted)."""
    if ref.fingerprint is None:
        return None
    try:
        now = fingerprint(ref.path)
    except OSError as exc:
        return f"{ref.path}: {exc.strerror} since the job was submitted"
    if now != ref.fingerprint:
        return (f"{ref.path}: the corpus changed after the job was submitted (was"
                f" {ref.fingerprint}, now {now}); resubmit to check it again")
    return None


def split_tokens(c: corpus.Corpus, valid_fraction: float) -> tuple[int, int]:
    """Tokens of the training part and of the held-out part of `c` (its last
    `held_out(documents, valid_fraction)` documents)."""
    total = c.header.tokens
    held = held_out(c.header.documents, valid_fraction)
    if not held:
        return total, 0
    first_seq = int(c.boundaries[c.header.documents - held])
    valid = int(np.asarray(c.lengths[first_seq:], dtype=np.int64).sum())
    return total - valid, valid


def held_out(documents: int, fraction: float) -> int:
    """How many of a corpus's last documents `valid_fraction` holds out (at least one when the
    fraction is not 0)."""
    if not fraction or not documents:
        return 0
    return max(1, int(documents * fraction))


def check_data(spec: JobSpec) -> JobSpec:
    """SpecError naming the first corpus of `spec` that cannot be trained on and why; else the
    spec with every corpus's fingerprint."""
    data = spec.data
    if data.kind != "tokens":
        return spec
    need = spec.train.global_batch * spec.model.seq_len + 1
    out: dict[str, list[CorpusRef]] = {}
    for name in ("train", "valid"):
        refs = []
        for i, ref in enumerate(getattr(data, name)):
            field = f"data.{name}.{i}.path"
            try:
                header = corpus.check(ref.path, spec.model.vocab)
                fp = fingerprint(ref.path)
            except corpus.CorpusError as exc:
                raise SpecError(field, str(exc)) from None
            except OSError as exc:
                raise SpecError(field, f"{ref.path}: {exc.strerror}") from None
            parts = [("it holds", header.tokens)]
            if name == "train" and data.valid_fraction:
                c = corpus.Corpus(ref.path)
                train_part, valid_part = split_tokens(c, data.valid_fraction)
                parts = [("its training part holds", train_part),
                         (f"its held-out part (valid_fraction {data.valid_fraction:g}) holds",
                          valid_part)]
            for what, tokens in parts:
                if tokens < need:
                    raise SpecError(field, f"{corpus.bin_path(ref.path)}: too few tokens:"
                                    f" {what} {tokens}, one global batch needs"
                                    f" train.global_batch({spec.train.global_batch}) *"
                                    f" model.seq_len({spec.model.seq_len}) + 1 = {need}")
            refs.append(ref.model_copy(update={"fingerprint": fp}))
        out[name] = refs
    return spec.model_copy(update={"data": data.model_copy(update=out)})
