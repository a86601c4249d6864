"""End to end on real text through REST: Debian's license texts (on every machine of this kind)
prepared with `trident data prepare` and the GPT-2 tokenizer, trained on 2 CPU ranks on a real
local Ray; the validation loss (held-out documents) falls below the unigram entropy of the
training tokens, which only a model that uses the context can do."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from service.contract.states import JobState
from service.files import corpus, corpus_scan
from service.files.corpus_scan import FOLDER
from service.files.data_check import held_out
from service.files.order_cache import OrderCache, ServerData
from tests.conftest import tiny_spec
from tests.corpora import write_corpus
from tests.waiting import drive

pytestmark = pytest.mark.slow
LICENSES = "/usr/share/common-licenses"
STEPS = 120


def unigram_entropy(prefix: str, valid_fraction: float) -> float:
    """Entropy (nats) of the training part's token frequencies."""
    c = corpus.Corpus(prefix)
    docs = c.header.documents
    first_valid = int(c.boundaries[docs - held_out(docs, valid_fraction)])
    counts = np.bincount(np.asarray(c.tokens[:int(c.starts[first_valid])]))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@pytest.mark.skipif(not os.path.isdir(LICENSES), reason=f"no {LICENSES}")
def test_real_text_trains_below_the_unigram_entropy(stack, tmp_path) -> None:
    client, store, controller = stack
    texts = tmp_path / "texts"
    texts.mkdir()
    for path in sorted(glob.glob(f"{LICENSES}/*")):
        if os.path.isfile(path):
            shutil.copyfile(path, texts / (os.path.basename(path) + ".txt"))
    (tmp_path / "corpora").mkdir()
    prefix = str(tmp_path / "corpora" / "licenses")
    done = subprocess.run([sys.executable, "-m", "cli.main", "data", "prepare",
                           *sorted(glob.glob(f"{texts}/*.txt")), "--tokenizer", "gpt2",
                           "--out", prefix, "--workers", "2"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert " documents, " in done.stdout and "tokens/s (gpt2" in done.stdout
    entropy = unigram_entropy(prefix, 0.1)

    spec = tiny_spec(
        model={"preset": "gpt-tiny", "layers": 2, "hidden": 64, "heads": 4, "vocab": 50257,
               "seq_len": 32},
        train={"steps": STEPS, "global_batch": 8, "micro_batch": 4, "precision": "fp32",
               "lr": 0.005},
        parallel={"tp": 1, "pp": 1, "dp": 2, "zero": 0}, monitor={"probe": False},
        data={"kind": "tokens", "train": [{"path": prefix}], "valid_fraction": 0.1,
              "eval_every": 40, "eval_batches": 2})
    r = client.post("/api/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 900) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error

    rows = client.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    evals = {m["step"]: m["eval_loss"] for m in rows if m["eval_loss"] is not None}
    assert sorted(evals) == [40, 80, 120]
    assert evals[120] < entropy, (evals, entropy)
    assert rows[-1]["tokens"] == STEPS * 8 * 32
    assert [m["first_sample"] for m in rows[:3]] == [0, 8, 16]
    assert rows[-1]["drawn"] == {prefix: STEPS * 8} and rows[-1]["epoch"] > 0


def _phrases(root) -> str:
    """A small learnable corpus of gpt-tiny's vocabulary (256), under the data root."""
    rng = np.random.default_rng(0)
    phrases = [rng.integers(0, 255, 12).tolist() for _ in range(6)]
    docs = [[t for _ in range(int(rng.integers(2, 8))) for t in phrases[int(rng.integers(6))]]
            + [255] for _ in range(120)]
    root.mkdir(exist_ok=True)
    write_corpus(root / "phrases", docs)
    return str(root / "phrases")


def _resume_spec(prefix: str, **over: object) -> dict[str, object]:
    return tiny_spec(
        train={"steps": 8, "global_batch": 8, "micro_batch": 2, "precision": "fp32",
               "lr": 0.003},
        parallel={"tp": 1, "pp": 1, "dp": 2, "zero": 1}, monitor={"probe": False},
        checkpoint={"every_steps": 4},
        data={"kind": "tokens", "train": [{"path": prefix}], "valid_fraction": 0.1,
              "eval_every": 4, "eval_batches": 1}, **over)


def _newest_rows(client, job_id: int) -> list[dict]:
    """Rank 0's rows per step, the newest attempt's where a step ran twice."""
    rows: dict[int, dict] = {}
    for m in client.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"]:
        if m["step"] not in rows or m["attempt"] > rows[m["step"]]["attempt"]:
            rows[m["step"]] = m
    return [rows[s] for s in sorted(rows)]


def test_a_killed_rank_resumes_on_exactly_the_samples_of_the_straight_run(stack,
                                                                          tmp_path) -> None:
    client, store, controller = stack
    prefix = _phrases(tmp_path / "corpora")
    runs = []
    for over in ({}, {"faults": [{"kind": "kill", "rank": 1, "step": 6}], "max_retries": 1}):
        r = client.post("/api/v1/jobs", json=_resume_spec(prefix, **over))
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                     900) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
        runs.append(_newest_rows(client, job_id))
    straight, resumed = runs
    assert {m["attempt"] for m in resumed} == {1, 2}  # the kill cost an attempt
    assert [m["step"] for m in resumed] == list(range(1, 9))
    assert [m["first_sample"] for m in resumed] == [m["first_sample"] for m in straight]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight]  # fp32: identical
    assert [m["eval_loss"] for m in resumed] == [m["eval_loss"] for m in straight]
    assert resumed[-1]["drawn"] == straight[-1]["drawn"] == {prefix: 64}


def test_a_corpus_changed_after_submission_fails_the_job(stack, tmp_path) -> None:
    client, store, controller = stack
    prefix = _phrases(tmp_path / "corpora")
    r = client.post("/api/v1/jobs", json=_resume_spec(prefix))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    with open(prefix + ".bin", "ab") as f:  # rewritten before it trains: sizes disagree
        f.write(b"\x00\x00")
    assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 900) == JobState.FAILED
    error = store.get_job(job_id=job_id).error or ""
    assert f"{prefix}: the corpus changed after the job was submitted" in error, error
    assert client.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"] == []


def test_a_bin_replaced_by_a_symlink_outside_the_roots_never_trains(
        stack, tmp_path, tmp_path_factory) -> None:
    """The `.bin` swapped after submission for a symlink to a file outside the data roots
    (the stack's data directory) with the same size and modification time: rank 0 resolves
    the paths again and refuses it, and the controller does not retry."""
    client, store, controller = stack
    prefix = _phrases(tmp_path / "corpora")
    r = client.post("/api/v1/jobs", json=_resume_spec(prefix, max_retries=2))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    original = os.stat(prefix + ".bin")
    outside = tmp_path_factory.mktemp("outside") / "secret.bin"
    outside.write_bytes(bytes(original.st_size))  # other tokens, the same size
    os.utime(outside, ns=(original.st_atime_ns, original.st_mtime_ns))
    os.remove(prefix + ".bin")
    os.symlink(outside, prefix + ".bin")
    swapped = os.stat(prefix + ".bin")
    assert (swapped.st_size, swapped.st_mtime_ns) == (original.st_size, original.st_mtime_ns)

    assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 900) == JobState.FAILED
    job = store.get_job(job_id=job_id)
    error = job.error or ""
    assert f"{prefix}.bin' resolves to {outside.resolve()}, outside the server's data roots" \
        in error, error
    assert "not retried: " in error and "the corpus changed after the job was submitted" \
        in error, error
    assert len(store.list_attempts(job_id=job_id)) == 1
    assert client.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"] == []


def test_a_job_listing_one_corpus_64_times_caches_only_its_samples(stack, tmp_path) -> None:
    """On the live stack: a 2-step job that lists one corpus 64 times writes one sample order,
    no larger on disk than the per-user bound (64 KiB: 16 samples), under the data directory
    and nothing beside the corpus; the same job again reads it instead of writing another."""
    client, store, controller = stack
    prefix = _phrases(tmp_path / "corpora")
    before = sorted(os.listdir(tmp_path / "corpora"))
    cache = OrderCache.of(tmp_path, user_bytes=64 << 10, total_bytes=1 << 20)
    controller.launcher.server = ServerData(cache, data_roots=(str(tmp_path),))
    spec = tiny_spec(
        train={"steps": 2, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        parallel={"tp": 1, "pp": 1, "dp": 2, "zero": 1}, monitor={"probe": False},
        data={"kind": "tokens", "train": [{"path": prefix}] * 64})
    written = []
    for _ in range(2):
        r = client.post("/api/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                     900) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
        assert client.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"][-1]["drawn"] \
            == {prefix: 16}
        entries = [e for e in os.listdir(cache.root) if not e.startswith(".")]
        assert len(entries) == 1, entries
        written.append({f: os.stat(cache.root / entries[0] / f).st_ino
                        for f in os.listdir(cache.root / entries[0])})
        used = sum(os.stat(os.path.join(d, f)).st_blocks * 512
                   for d, _, files in os.walk(cache.root) for f in files)
        assert 0 < used <= cache.user_bytes, used
    assert written[0] == written[1]  # read again, not rewritten
    assert sorted(os.listdir(tmp_path / "corpora")) == before


@contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """`folder` read-only inside the block: mode 0555, and for root (whom modes do not stop)
    the immutable attribute (`chattr +i`); skipped where neither holds."""
    mode = folder.stat().st_mode
    folder.chmod(0o555)
    immutable = os.geteuid() == 0 and subprocess.run(
        ["chattr", "+i", str(folder)], capture_output=True, check=False).returncode == 0
    try:
        try:
            (folder / ".probe").touch()
        except OSError:
            pass
        else:
            (folder / ".probe").unlink()
            pytest.skip(f"{folder} cannot be made read-only here")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(mode)


def test_a_corpus_in_a_read_only_folder_trains(stack, tmp_path) -> None:
    """A corpus prepared by Megatron's tool (no `PREFIX.meta.json`) in a folder nobody may
    write: submitted (its scan recorded under the data directory), its sample order built
    under the data directory, trained to the end on real ranks; the folder as it was."""
    client, store, controller = stack
    folder = tmp_path / "corpora"
    prefix = _phrases(folder)
    before = sorted(os.listdir(folder))
    with read_only(folder):
        r = client.post("/api/v1/jobs", json=_resume_spec(prefix))
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                     900) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
    assert sorted(os.listdir(folder)) == before
    assert corpus_scan.recorded(prefix, tmp_path) is not None
    assert os.listdir(tmp_path / FOLDER)
