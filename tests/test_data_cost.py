"""A submission costs what its spec says, not what its corpora weigh
(`service.files.data_check`,
`service.files.corpus`): a header check takes the same memory for 8x the sequences, a corpus listed
128 times is read once, checks beyond the server's and the user's bounds wait and are then
refused, and a slow check does not spend `parallel: auto`'s search budget."""

from __future__ import annotations

import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from api.app import create_app
from service.files import corpus_scan
from service.files.data_check import CHECK_SLOTS, ChecksBusy, CheckSlots
from service.settings import Settings
from service.store import Store
from tests.conftest import tiny_spec, user_token
from tests.corpora import write_corpus
from tests.servers import ROOT, serving


def write_many_sequences(prefix: Path, n: int) -> None:
    """A corpus of `n` one-token sequences in one document, in Megatron's layout
    (`tests/corpora.py`), written in chunks; its `.bin` (all token 0) is sparse."""
    chunk = 1 << 20
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, 2))
        for start in range(0, n, chunk):
            f.write(np.ones(min(chunk, n - start), np.int32).tobytes())
        for start in range(0, n, chunk):
            f.write((np.arange(start, min(start + chunk, n), dtype=np.int64) * 2).tobytes())
        f.write(np.array([0, n], np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(2 * n)


PEAK_RSS = """
import sys
from service.files.corpus import read_header
from workers.monitor.proc_status import status_kib
h = read_header(sys.argv[1])
print(h.sequences, h.tokens, status_kib()["VmHWM"])
"""
"""The peak is this process's own (`VmHWM`, kept per address space): `ru_maxrss` keeps the
forking process's peak across `exec`, so it read the test worker's size, not the check's."""


def checked_peak_rss(prefix: Path) -> tuple[int, int, int]:
    """(sequences, tokens, peak RSS in KiB) of a process that checks the header of `prefix`."""
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, str(prefix)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=300).stdout.split()
    seqs, tokens, kib = map(int, out)
    return seqs, tokens, kib


def test_a_header_check_takes_the_same_memory_for_8x_the_sequences(tmp_path: Path) -> None:
    """1M and 8M sequences, each checked in a process of its own: with whole arrays the
    larger took 28 MiB more at its peak; read in chunks, the same within 4 MiB."""
    sizes = {}
    for n in (1 << 20, 8 << 20):
        prefix = tmp_path / f"c{n}"
        write_many_sequences(prefix, n)
        seqs, tokens, kib = checked_peak_rss(prefix)
        assert seqs == tokens == n
        sizes[n] = kib
        (tmp_path / f"c{n}.idx").unlink()
    grown_mib = (sizes[8 << 20] - sizes[1 << 20]) / 1024
    assert grown_mib < 4, sizes


def read_bytes() -> int:
    """Bytes this process has read through read(2) and its kin (`rchar`), page cache or not."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.fixture
def corpora(tmp_path: Path) -> Path:
    root = tmp_path / "corpora"
    root.mkdir()
    return root


@contextmanager
def served(store: Store, data_dir: Path, corpora: Path,
           **settings: Any) -> Iterator[tuple[str, dict[str, str]]]:
    """A served app whose data root is `corpora`, with `settings`; a member's headers."""
    app = create_app(Settings(data_dir=data_dir, data_roots=str(corpora), **settings),
                     store=store)
    with serving(app) as url:
        yield url, {"Authorization": f"Bearer {user_token(store, 'alice', 'member')}"}


def tokens_spec(prefix: Path, listed: int = 1, valid: int = 0, **over: Any) -> dict[str, Any]:
    """`tiny_spec` training on `prefix` listed `listed` times, validating on it `valid`."""
    data = {"kind": "tokens", "train": [{"path": str(prefix)}] * listed,
            "valid": [{"path": str(prefix)}] * valid}
    return tiny_spec(data=data, **over)


def test_a_corpus_listed_128_times_is_read_once(sqlite_store: Store, tmp_path: Path,
                                                corpora: Path) -> None:
    """An int32 corpus (its `.bin` scanned for token ids, 8 MB): listed once and listed 128
    times (64 training, 64 validation), the submission reads its files once."""
    prefix = corpora / "web"
    write_corpus(prefix, [[i % 256] * 2000 for i in range(1000)], np.int32)
    size = (corpora / "web.bin").stat().st_size + (corpora / "web.idx").stat().st_size
    spent = []
    with served(sqlite_store, tmp_path / "data", corpora) as (url, headers):
        for train, valid in ((1, 0), (64, 64)):
            before = read_bytes()
            r = httpx.post(f"{url}/api/v1/jobs", json=tokens_spec(prefix, train, valid),
                           headers=headers, timeout=60)
            assert r.status_code == 201, r.text
            spent.append(read_bytes() - before)
    once, listed_128 = spent
    assert once >= size  # the check reads both files
    assert listed_128 < once + size // 4, (once, listed_128)


def test_checks_beyond_the_bounds_wait_then_are_429_or_503(
        sqlite_store: Store, corpora: Path, tmp_path: Path) -> None:
    """The slots are lock files every API process shares: held here, as another process's
    checks would hold them. Over the user's bound a 429, over the server's a 503, after the
    wait; a slot freed within the wait lets the submission through."""
    with served(sqlite_store, tmp_path / "data", corpora, data_checks=2,
                data_checks_per_user=1, data_check_wait_s=0.5) as (url, headers):
        over_the_bounds(url, headers, sqlite_store, corpora, tmp_path)


def over_the_bounds(url: str, headers: dict[str, str], store: Store, corpora: Path,
                    tmp_path: Path) -> None:
    write_corpus(corpora / "web", [[1] * 300] * 4)
    slots = CheckSlots(tmp_path / "data" / CHECK_SLOTS, total=2, per_user=1, wait_s=0)

    def post(who: dict[str, str]) -> httpx.Response:
        return httpx.post(f"{url}/api/v1/jobs", json=tokens_spec(corpora / "web"), headers=who,
                          timeout=30)

    with slots.held("alice"):
        start = time.monotonic()
        r = post(headers)
        assert r.status_code == 429, r.text
        assert time.monotonic() - start >= 0.5  # it waited first
        assert "TRIDENT_DATA_CHECKS_PER_USER" in r.json()["detail"]
        assert r.headers["Retry-After"]
        with slots.held("carol"):
            bob = {"Authorization": f"Bearer {user_token(store, 'bob', 'member')}"}
            r = post(bob)
            assert r.status_code == 503, r.text
            assert "TRIDENT_DATA_CHECKS" in r.json()["detail"]
    held = slots.held("alice")
    held.__enter__()
    threading.Timer(0.2, held.__exit__, (None, None, None)).start()
    r = post(headers)
    assert r.status_code == 201, r.text


def test_a_slow_data_check_does_not_spend_the_search_budget(
        sqlite_store: Store, corpora: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that spends more CPU than `parallel: auto`'s search may (0.5 s), then an auto
    layout of 8 ranks: planned, not refused for the search's budget."""
    write_corpus(corpora / "web", [[1] * 300] * 20)
    real = corpus_scan.scan

    def slow(prefix: str, stop: threading.Event | None = None) -> corpus_scan.Scan:
        start = time.thread_time()
        while time.thread_time() - start < 0.7:
            pass
        return real(prefix, stop)

    monkeypatch.setattr(corpus_scan, "scan", slow)
    spec = tokens_spec(corpora / "web", parallel="auto",
                       train={"steps": 6, "global_batch": 64, "precision": "fp32"},
                       cluster={"gpu": "cpu", "nodes": 1, "gpus_per_node": 8})
    with served(sqlite_store, tmp_path / "data", corpora) as (url, headers):
        r = httpx.post(f"{url}/api/v1/jobs", json=spec, headers=headers, timeout=60)
    assert r.status_code == 201, r.text
    assert r.json()["plan"]["chosen_by"] == "search"


HOLDER = """
import sys
from pathlib import Path
from service.files.data_check import CheckSlots
with CheckSlots(Path(sys.argv[1]), total=1, per_user=1, wait_s=0).held("carol"):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_the_server_bound_holds_across_processes(tmp_path: Path) -> None:
    """A slot held by another process (another API process of the server) is taken; it is
    free again once that process ends, however it ends."""
    folder = tmp_path / CHECK_SLOTS
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        slots = CheckSlots(folder, total=1, per_user=1, wait_s=0.2)
        with pytest.raises(ChecksBusy) as busy, slots.held("alice"):
            pass
        assert busy.value.status == 503 and "TRIDENT_DATA_CHECKS" in busy.value.message
    finally:
        holder.kill()
        holder.wait(30)
    with slots.held("alice"):
        pass
