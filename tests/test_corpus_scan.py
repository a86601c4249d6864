"""No corpus scan in a request: a submission reads a corpus's `.idx` and its `PREFIX.meta.json`
(or the data directory's record), never its `.bin` when that is larger than
`corpus_scan.INLINE_BYTES`; a corpus no record describes is scanned by the controller before
admission (or by `trident data inspect --index`) and the result recorded under the data
directory; an out-of-vocabulary corpus is refused at submission when its record says so, and
its job FAILED before any rank starts when the controller finds it.

Which files a request opens is read from Python's audit hook (`open` events: `open`,
`os.open`, `numpy.memmap` alike), a structural check rather than a timing."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.cluster.data_plane import PollResult
from service.contract.states import JobState
from service.files import corpus, corpus_scan
from service.files.corpus_prepare import inspect
from service.settings import Settings
from service.store import Store
from tests.conftest import tiny_spec, user_token
from tests.corpora import write_corpus
from tests.fakes import FakeLauncher, make

VOCAB = 256  # gpt-tiny's
BIG_TOKENS = 48 << 20
"""96 MiB of uint16 tokens: past `INLINE_BYTES`, so never scanned at submission."""

_opened: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, Path)):
        _opened.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)


@contextmanager
def opened() -> Iterator[list[str]]:
    """The real paths of the files this process opens inside the block (every thread)."""
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def sparse_corpus(prefix: Path, tokens: int, last: int = 0, doc: int = 1 << 20) -> None:
    """A uint16 corpus of `tokens` zeros in documents of `doc` tokens, the last token `last`:
    its `.bin` a sparse file (a few blocks on disk, whatever its size)."""
    n = -(-tokens // doc)
    lengths = np.full(n, doc, np.int32)
    lengths[-1] = tokens - doc * (n - 1)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * 2)])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(corpus.MAGIC + struct.pack("<QBQQ", 1, 8, n, n + 1))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes()
                + np.arange(n + 1, dtype=np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(tokens * 2)
        if last:
            f.seek(tokens * 2 - 2)
            f.write(np.array([last], np.uint16).tobytes())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "corpora"
    r.mkdir()
    return r


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def client(sqlite_store: Store, data_dir: Path, root: Path) -> Iterator[TestClient]:
    s = Settings(data_dir=data_dir, data_roots=str(root))
    with TestClient(create_app(s, store=sqlite_store)) as c:
        c.headers["Authorization"] = f"Bearer {user_token(sqlite_store, 'alice', 'member')}"
        yield c


def submit(client: TestClient, prefix: Path) -> Any:
    return client.post("/api/v1/jobs", json=tiny_spec(
        data={"kind": "tokens", "train": [{"path": str(prefix)}]}))


def docs(top: int = VOCAB - 1) -> list[list[int]]:
    rng = np.random.default_rng(1)
    out = [rng.integers(0, VOCAB - 1, 50).tolist() for _ in range(40)]
    out[7][3] = top
    return out


def test_a_submission_reads_the_meta_file_and_never_the_bin(client: TestClient,
                                                             root: Path) -> None:
    """A small corpus with its `PREFIX.meta.json`: the request opens the `.idx` and the
    record, not the `.bin`; the record's largest id out of the vocabulary is the 422, still
    without a read of the `.bin`."""
    prefix = root / "web"
    write_corpus(prefix, docs())
    corpus_scan.write_meta(str(prefix), corpus_scan.scan(str(prefix)))
    with opened() as files:
        r = submit(client, prefix)
    assert r.status_code == 201, r.text
    assert f"{prefix}.idx" in files and f"{prefix}.meta.json" in files
    assert f"{prefix}.bin" not in files

    write_corpus(prefix, docs(top=VOCAB))
    corpus_scan.write_meta(str(prefix), corpus_scan.scan(str(prefix)))
    with opened() as files:
        r = submit(client, prefix)
    assert r.status_code == 422, r.text
    [d] = r.json()["detail"]
    assert d["loc"] == ["body", "data", "train", "0", "path"]
    assert d["msg"] == (f"{prefix}.bin: token id {VOCAB} (first at token 353) is at or above"
                        f" the model's vocabulary model.vocab({VOCAB})")
    assert f"{prefix}.bin" not in files


def test_a_stale_meta_file_is_not_believed(client: TestClient, root: Path) -> None:
    """A record of an earlier version of the files (another size or modification time) is
    ignored: the small corpus is scanned at submission, and its bad token refused."""
    prefix = root / "web"
    write_corpus(prefix, docs())
    corpus_scan.write_meta(str(prefix), corpus_scan.scan(str(prefix)))
    write_corpus(prefix, docs(top=VOCAB + 5))
    os.utime(f"{prefix}.bin", ns=(1, 1))
    with opened() as files:
        r = submit(client, prefix)
    assert r.status_code == 422 and f"token id {VOCAB + 5}" in r.text, r.text
    assert f"{prefix}.bin" in files


def _controller(store: Store, data_dir: Path, tmp_path: Path) -> tuple[Any, FakeLauncher]:
    launcher = FakeLauncher([[PollResult(state="starting")]])
    return make(store, launcher, tmp_path / "ckpt", data_dir=data_dir), launcher


def _until(c: Any, store: Store, job_id: int, states: set[JobState]) -> JobState:
    deadline = time.monotonic() + 60
    while True:
        c.step()
        state = store.get_job(job_id=job_id).state
        if state in states or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


def test_a_large_corpus_without_a_record_is_scanned_by_the_controller(
        client: TestClient, sqlite_store: Store, root: Path, data_dir: Path,
        tmp_path: Path) -> None:
    """96 MiB of tokens, no `PREFIX.meta.json`: the submission does not open the `.bin`; the
    controller scans it beside its loop (the job queued meanwhile), records the scan under
    the data directory, and admits the job; a second job on it is admitted without a scan."""
    prefix = root / "big"
    sparse_corpus(prefix, BIG_TOKENS, last=VOCAB - 1)
    with opened() as files:
        r = submit(client, prefix)
    assert r.status_code == 201, r.text
    assert f"{prefix}.idx" in files and f"{prefix}.bin" not in files
    job_id = r.json()["id"]
    c, launcher = _controller(sqlite_store, data_dir, tmp_path)
    c.step()
    assert sqlite_store.get_job(job_id=job_id).state == JobState.QUEUED
    assert _until(c, sqlite_store, job_id, {JobState.PLACING, JobState.RUNNING,
                                            JobState.FAILED}) != JobState.FAILED
    assert len(launcher.started) == 1
    [cached] = (data_dir / corpus_scan.FOLDER).iterdir()
    assert cached == corpus_scan.cache_file(data_dir, str(prefix),
                                            corpus_scan.scan_print(str(prefix)))
    found = corpus_scan.recorded(str(prefix), data_dir)
    assert found is not None and found.max_token == VOCAB - 1
    assert found.max_at == BIG_TOKENS - 1 and found.tokens == BIG_TOKENS
    c.shutdown()

    second = submit(client, prefix).json()["id"]
    c, launcher = _controller(sqlite_store, data_dir, tmp_path)
    with opened() as files:
        c.step()
    assert sqlite_store.get_job(job_id=second).state in {JobState.PLACING, JobState.RUNNING}
    assert f"{prefix}.bin" not in files and str(cached) in files
    c.shutdown()


def test_an_out_of_vocabulary_corpus_found_by_the_controller_fails_its_job(
        client: TestClient, sqlite_store: Store, root: Path, data_dir: Path,
        tmp_path: Path) -> None:
    """The scan finds a token id at the vocabulary: the job FAILED with the field, the file
    and the id, and no group started; the submission was accepted (it could not know)."""
    prefix = root / "big"
    sparse_corpus(prefix, BIG_TOKENS, last=VOCAB)
    r = submit(client, prefix)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    c, launcher = _controller(sqlite_store, data_dir, tmp_path)
    assert _until(c, sqlite_store, job_id, {JobState.FAILED, JobState.PLACING}) \
        == JobState.FAILED
    job = sqlite_store.get_job(job_id=job_id)
    assert job.error == (f"data.train.0.path: {prefix}.bin: token id {VOCAB} (first at token"
                         f" {BIG_TOKENS - 1}) is at or above the model's vocabulary"
                         f" model.vocab({VOCAB})")
    assert launcher.started == [] and job.attempts == 0
    c.shutdown()
    # Now recorded: the next submission on it is the 422.
    r = submit(client, prefix)
    assert r.status_code == 422 and f"token id {VOCAB}" in r.text, r.text


def test_inspect_index_records_the_scan_where_the_controller_finds_it(
        root: Path, data_dir: Path) -> None:
    prefix = str(root / "megatron")
    sparse_corpus(Path(prefix), 1000, last=17, doc=100)
    assert inspect(prefix, samples=0, data_dir=data_dir)["scan"] == "scanned"
    assert corpus_scan.recorded(prefix, data_dir) is None  # not recorded without --index
    info = inspect(prefix, samples=0, data_dir=data_dir, index=True)
    assert info["scan"] == "recorded" and info["max_token"] == 17
    again = inspect(prefix, samples=0, data_dir=data_dir)
    assert again["scan"] == "data_dir" and again["max_token"] == 17
    assert not os.path.exists(corpus_scan.meta_path(prefix))  # the corpus folder untouched


def test_the_inspect_command_records_under_trident_data_dir(root: Path, data_dir: Path) -> None:
    """`trident data inspect PREFIX --index` records the scan in `TRIDENT_DATA_DIR`; the next
    inspect reads it from there and says so."""
    prefix = str(root / "megatron")
    sparse_corpus(Path(prefix), 1000, last=17, doc=100)
    env = {**os.environ, "TRIDENT_DATA_DIR": str(data_dir)}

    def run(*extra: str) -> str:
        done = subprocess.run([sys.executable, "-m", "cli.main", "data", "inspect", prefix,
                               "--samples", "0", *extra], capture_output=True, text=True,
                              env=env, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "largest token id 17 (scanned now, recorded in the data directory)" \
        in run("--index")
    assert "largest token id 17 (from the data directory's record)" in run()
    assert corpus_scan.recorded(prefix, data_dir) is not None


def test_a_stopping_controller_does_not_wait_for_a_scan(
        client: TestClient, sqlite_store: Store, root: Path, data_dir: Path,
        tmp_path: Path) -> None:
    """A scan of 8 GiB of tokens under way when the controller shuts down ends at its next
    chunk: nothing is recorded, and the job stays queued for the next controller."""
    prefix = root / "huge"
    sparse_corpus(prefix, 4 << 30)
    job_id = submit(client, prefix).json()["id"]
    c, launcher = _controller(sqlite_store, data_dir, tmp_path)
    c.step()
    assert c.corpora.scanning
    time.sleep(0.2)
    c.shutdown()
    deadline = time.monotonic() + 3  # the whole scan takes tens of seconds
    while c.corpora.scanning and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not c.corpora.scanning
    assert corpus_scan.recorded(str(prefix), data_dir) is None
    assert sqlite_store.get_job(job_id=job_id).state == JobState.QUEUED
    assert launcher.started == []
