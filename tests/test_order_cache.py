"""The sample-order cache on real corpus files (Megatron's layout), through the rank-side data
opening (`workers.trainer.data.open_source`): a job that lists one corpus 64 times writes an order
no larger than the samples it needs, in the cache under the data directory and never beside the
corpus; another job with the same corpus reuses it; the least recently used orders go past the
total bound, never one a job reads; the per-user bound refuses, at submission when the order
alone is bigger, else when the rank builds it."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.contract.spec import JobSpec
from service.files.order_cache import OrderCache, ServerData
from service.settings import Settings
from service.store import Store
from tests.conftest import tiny_spec, user_token
from tests.corpora import write_corpus
from workers.trainer.data import DataChanged, TokenSource, open_source

SEQ_LEN = 32  # gpt-tiny's


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A corpus of 400,000 tokens (4,000 documents): one epoch is 12,499 windows."""
    root = tmp_path_factory.mktemp("corpora")
    rng = np.random.default_rng(0)
    write_corpus(root / "web", [rng.integers(0, 256, 100).tolist() for _ in range(4000)])
    return str(root / "web")


def job(prefix: str, *, listed: int = 1, steps: int = 2, seed: int = 1) -> JobSpec:
    return JobSpec.model_validate(tiny_spec(
        train={"steps": steps, "global_batch": 8, "micro_batch": 2, "seed": seed},
        data={"kind": "tokens", "train": [{"path": prefix}] * listed}))


def server(tmp_path: Path, *, user: int = 1 << 30, total: int = 1 << 30) -> ServerData:
    return ServerData(OrderCache.of(tmp_path / "data", user, total), data_roots=("/",))


def on_disk(folder: Path) -> int:
    """Bytes the files under `folder` take on the disk (their allocated blocks)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512
               for d, _, files in os.walk(folder) for f in files)


def entries(s: ServerData) -> list[str]:
    return sorted(n for n in os.listdir(s.orders.root) if not n.startswith("."))


def test_a_corpus_listed_64_times_caches_only_the_samples_the_job_needs(
        big: str, tmp_path: Path) -> None:
    s = server(tmp_path, user=64 << 10)
    before = sorted(os.listdir(os.path.dirname(big)))
    source = open_source(job(big, listed=64), dp_rank=0, rank=0, server=s, user="alice")
    assert isinstance(source, TokenSource)
    assert sorted(os.listdir(os.path.dirname(big))) == before  # nothing beside the corpus
    assert source.paths == [big]  # indexed once
    assert len(entries(s)) == 1
    written = on_disk(s.orders.root)
    # 16 samples: within the 64 KiB bound, where one whole epoch's sample and shuffle index
    # (12,499 windows, 16 bytes each) of a single entry would take 195 KiB.
    assert 0 < written <= s.orders.user_bytes < 12_499 * 16, written
    assert s.orders.held("alice") >= written - 4096
    rows = [source.sample(j).tolist() for j in range(16)]
    assert all(len(r) == SEQ_LEN + 1 for r in rows)
    assert source.progress(16).drawn == {big: 16}


def test_a_second_job_with_the_same_corpus_reuses_the_order(big: str, tmp_path: Path) -> None:
    s = server(tmp_path)
    first = open_source(job(big, listed=3), dp_rank=0, rank=0, server=s, user="alice")
    [entry] = entries(s)
    arrays = {f: os.stat(s.orders.root / entry / f).st_ino
              for f in os.listdir(s.orders.root / entry) if f.endswith(".npy")}
    second = open_source(job(big, listed=3), dp_rank=0, rank=0, server=s, user="bob")
    assert entries(s) == [entry]
    assert {f: os.stat(s.orders.root / entry / f).st_ino for f in arrays} == arrays
    assert [second.sample(j).tolist() for j in range(16)] == \
        [first.sample(j).tolist() for j in range(16)]
    assert s.orders.held("alice") == s.orders.held("bob") == s.orders.held() > 0


def test_least_recently_used_orders_go_past_the_total_bound(big: str, tmp_path: Path) -> None:
    probe = server(tmp_path / "probe")
    open_source(job(big, seed=99), dp_rank=0, rank=0, server=probe, user="alice")
    one = probe.orders.held()
    s = server(tmp_path, total=3 * one + one // 2)  # room for three orders
    running = open_source(job(big, seed=1), dp_rank=0, rank=0, server=s, user="alice")
    order_of = {}
    for seed in (2, 3, 4, 5):
        source = open_source(job(big, seed=seed), dp_rank=0, rank=0, server=s, user="bob")
        order_of[seed] = source.train_order.folder.name  # type: ignore[attr-defined]
        del source
        gc.collect()  # the job ended: its order is no longer read
        assert on_disk(s.orders.root) <= s.orders.total_bytes
        assert s.orders.held() <= s.orders.total_bytes
    kept = entries(s)
    assert running.train_order.folder.name in kept  # type: ignore[attr-defined]
    assert order_of[2] not in kept and order_of[3] not in kept  # least recently used first
    assert order_of[4] in kept and order_of[5] in kept
    assert len(kept) == 3


def test_the_per_user_bound_refuses_when_the_rank_builds(big: str, tmp_path: Path) -> None:
    probe = server(tmp_path / "probe")
    open_source(job(big, seed=99), dp_rank=0, rank=0, server=probe, user="alice")
    one = probe.orders.held()
    s = server(tmp_path, user=one + one // 2)  # room for one order a user
    running = open_source(job(big, seed=1), dp_rank=0, rank=0, server=s, user="alice")
    with pytest.raises(DataChanged, match=r"passes the per-user bound"
                       r" TRIDENT_ORDER_CACHE_USER_BYTES \(") as refused:
        open_source(job(big, seed=2), dp_rank=0, rank=0, server=s, user="alice")
    assert "\n" not in str(refused.value)
    assert len(entries(s)) == 1
    open_source(job(big, seed=2), dp_rank=0, rank=0, server=s, user="bob")  # bob's own room
    del running
    gc.collect()  # alice's job ended: her next order replaces the one it read
    open_source(job(big, seed=3), dp_rank=0, rank=0, server=s, user="alice")
    assert s.orders.held("alice") <= s.orders.user_bytes
    assert len(entries(s)) == 2


def test_a_rank_on_a_host_without_the_shared_cache_builds_the_same_order(
        big: str, tmp_path: Path) -> None:
    """Rank 1 on a host whose data directory is not rank 0's (not shared storage) finds no
    order there: it builds the same one into its host's cache instead of failing."""
    head, other = server(tmp_path / "head"), server(tmp_path / "other")
    first = open_source(job(big, listed=2), dp_rank=0, rank=0, server=head, user="alice")
    second = open_source(job(big, listed=2), dp_rank=1, rank=1, server=other, user="alice")
    assert entries(head) == entries(other) and len(entries(other)) == 1
    assert [second.sample(j).tolist() for j in range(16)] == \
        [first.sample(j).tolist() for j in range(16)]


@pytest.fixture
def client(sqlite_store: Store, tmp_path: Path) -> Iterator[TestClient]:
    s = Settings(data_dir=tmp_path / "data", data_roots=str(tmp_path),
                 order_cache_user_bytes=1 << 20)
    with TestClient(create_app(s, store=sqlite_store)) as c:
        c.headers["Authorization"] = f"Bearer {user_token(sqlite_store, 'alice', 'member')}"
        yield c


def test_the_per_user_bound_refuses_at_submission(client: TestClient, tmp_path: Path) -> None:
    prefix = tmp_path / "web"
    write_corpus(prefix, [[1] * 300 for _ in range(10)])
    spec = tiny_spec(train={"steps": 8000, "global_batch": 8, "micro_batch": 2},
                     data={"kind": "tokens", "train": [{"path": str(prefix)}]})
    r = client.post("/api/v1/jobs", json=spec)
    assert r.status_code == 422, r.text
    [d] = r.json()["detail"]
    assert d["loc"][-2:] == ["train", "steps"], d
    assert "per-user bound TRIDENT_ORDER_CACHE_USER_BYTES (1.0 MiB)" in d["msg"], d
    spec["train"]["steps"] = 100  # type: ignore[index]
    assert client.post("/api/v1/jobs", json=spec).status_code == 201


def test_a_rank_refuses_a_bin_replaced_after_rank_0_checked_it(big: str, tmp_path: Path) -> None:
    """Rank 0 built the order; the `.bin` is replaced (same size and modification time)
    before another rank opens it: that rank refuses it rather than read another file."""
    import shutil

    from service.contract.spec import CorpusRef
    from service.files.data_check import fingerprint

    prefix = str(tmp_path / "web")
    for ext in (".idx", ".bin"):
        shutil.copyfile(big + ext, prefix + ext)
    spec = job(prefix).model_copy()
    ref = CorpusRef(path=prefix, fingerprint=fingerprint(prefix))
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"train": [ref]})})
    s = server(tmp_path)
    open_source(spec, dp_rank=0, rank=0, server=s, user="alice")
    old = os.stat(prefix + ".bin")
    other = tmp_path / "other.bin"
    other.write_bytes(bytes(old.st_size))
    os.utime(other, ns=(old.st_atime_ns, old.st_mtime_ns))
    os.replace(other, prefix + ".bin")
    with pytest.raises(ValueError, match=r"web\.bin: the corpus changed after the job was"
                       r" submitted"):
        open_source(spec, dp_rank=1, rank=1, server=s, user="alice")
