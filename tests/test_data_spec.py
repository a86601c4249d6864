"""The `data` section of the spec: its bounds, the data roots, and every refusal of a corpus at
submission as a 422 naming the field, the file and the reason (through the API)."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api.app import create_app
from service.contract.spec import CorpusRef, JobSpec
from service.files.data_check import changed, fingerprint
from service.settings import Settings
from service.store import Store
from tests.conftest import tiny_spec, user_token
from tests.corpora import write_corpus

VOCAB = 256  # gpt-tiny's
NEED = 8 * 32 + 1  # global_batch * seq_len + 1 of tiny_spec


def docs(n: int = 40, length: int = 50) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, VOCAB, length).tolist() for _ in range(n)]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "corpora"
    r.mkdir()
    return r


@pytest.fixture
def client(sqlite_store: Store, tmp_path: Path, root: Path) -> Iterator[TestClient]:
    s = Settings(data_dir=tmp_path / "data", data_roots=str(root))
    with TestClient(create_app(s, store=sqlite_store)) as c:
        c.headers["Authorization"] = f"Bearer {user_token(sqlite_store, 'alice', 'member')}"
        yield c


def submit(client: TestClient, **data: Any) -> Any:
    return client.post("/api/v1/jobs", json=tiny_spec(data={"kind": "tokens", **data}))


def refusal(r: Any) -> tuple[list[Any], str]:
    assert r.status_code == 422, r.text
    [d] = r.json()["detail"]
    return d["loc"], d["msg"]


def test_a_good_corpus_is_accepted_and_fingerprinted(client: TestClient, root: Path) -> None:
    write_corpus(root / "web", docs())
    r = submit(client, train=[{"path": str(root / "web"), "weight": 0.7}],
               valid_fraction=0.25, eval_every=2)
    assert r.status_code == 201, r.text
    data = r.json()["spec"]["data"]
    assert data["kind"] == "tokens" and data["train"][0]["weight"] == 0.7
    ref = CorpusRef.model_validate(data["train"][0])
    assert ref.fingerprint and ref.fingerprint.startswith("idx:")
    assert changed(ref) is None
    write_corpus(root / "web", docs(41))  # rewritten after submission
    assert "changed after the job was submitted" in (changed(ref) or "")


def test_a_file_replaced_with_the_same_size_and_mtime_is_a_change(root: Path) -> None:
    """Another file of the same size and modification time in the `.bin`'s place (here a
    hard link to a copy, so no symlink is involved): its inode and status-change time
    differ from the fingerprint's; a spec stored with the older fingerprint (sizes and
    times only) still compares."""
    write_corpus(root / "web", docs())
    ref = CorpusRef(path=str(root / "web"), fingerprint=fingerprint(str(root / "web")))
    old = os.stat(root / "web.bin")
    copy = root / "copy.bin"
    copy.write_bytes(bytes(old.st_size))
    os.utime(copy, ns=(old.st_atime_ns, old.st_mtime_ns))
    os.replace(copy, root / "web.bin")
    now = os.stat(root / "web.bin")
    assert (now.st_size, now.st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    assert "changed after the job was submitted" in (changed(ref) or "")
    sizes_and_times = ",".join(":".join(p.split(":")[:3]) for p in ref.fingerprint.split(","))
    assert changed(ref.model_copy(update={"fingerprint": sizes_and_times})) is None


def test_synthetic_stays_the_default(client: TestClient) -> None:
    r = client.post("/api/v1/jobs", json=tiny_spec())
    assert r.status_code == 201 and r.json()["spec"]["data"]["kind"] == "synthetic"


@pytest.mark.parametrize(("data", "loc", "words"), [
    ({"kind": "tokens"}, ["body", "data"], "kind 'tokens' needs at least one training corpus"),
    ({"kind": "tokens", "train": [{"path": "rel/x"}]}, ["body", "data", "train", 0, "path"],
     "is not an absolute path"),
    ({"kind": "tokens", "train": [{"path": "/x", "weight": 0}]},
     ["body", "data", "train", 0, "weight"], "greater than 0"),
    ({"kind": "tokens", "train": [{"path": "/x"}], "valid": [{"path": "/y"}],
      "valid_fraction": 0.1}, ["body", "data"], "not both"),
    ({"kind": "tokens", "train": [{"path": "/x"}], "eval_every": 5}, ["body", "data"],
     "needs validation data"),
    ({"kind": "tokens", "train": [{"path": "/x"}], "valid_fraction": 0.6},
     ["body", "data", "valid_fraction"], "less than or equal to 0.5"),
    ({"kind": "synthetic", "train": [{"path": "/x"}]}, ["body", "data"],
     "corpora are for kind 'tokens'"),
    ({"kind": "tokens", "train": [{"path": "/x"}] * 65}, ["body", "data", "train"],
     "at most 64"),
])
def test_the_data_section_is_bounded(client: TestClient, data: dict[str, Any],
                                     loc: list[Any], words: str) -> None:
    r = client.post("/api/v1/jobs", json=tiny_spec(data=data))
    got_loc, msg = refusal(r)
    assert got_loc[:len(loc)] == loc and words in msg, (got_loc, msg)


def test_the_sample_order_is_bounded() -> None:
    with pytest.raises(ValidationError, match=r"samples exceed the 2147483648"):
        JobSpec.model_validate(tiny_spec(
            train={"steps": 10_000_000, "global_batch": 1024, "micro_batch": 2},
            data={"kind": "tokens", "train": [{"path": "/x"}]}))


def test_corpora_lie_inside_the_data_roots(client: TestClient, root: Path,
                                           tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    write_corpus(outside / "c", docs())
    (root / "link.idx").symlink_to(outside / "c.idx")
    (root / "link.bin").symlink_to(outside / "c.bin")
    for path in [str(outside / "c"), f"{root}/../outside/c", str(root / "link")]:
        loc, msg = refusal(submit(client, train=[{"path": path}]))
        assert loc == ["body", "data", "train", "0", "path"], loc
        assert "outside the server's data roots (TRIDENT_DATA_ROOTS)" in msg
        assert msg.endswith(str(root.resolve())), msg
    write_corpus(root / "ok", docs())
    loc, msg = refusal(submit(client, train=[{"path": str(root / "ok")}],
                              valid=[{"path": str(outside / "c")}]))
    assert loc == ["body", "data", "valid", "0", "path"] and "outside" in msg
    assert client.get("/api/v1/jobs").json()["total"] == 0


def _corrupt(prefix: Path, what: str) -> None:
    write_corpus(prefix, docs())
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    raw = idx.read_bytes()
    if what == "missing idx":
        idx.unlink()
    elif what == "missing bin":
        bin_.unlink()
    elif what == "magic":
        idx.write_bytes(b"NOTMEGA\x00\x00" + raw[9:])
    elif what == "version":
        idx.write_bytes(raw[:9] + struct.pack("<Q", 3) + raw[17:])
    elif what == "idx size":
        idx.write_bytes(raw[:-8])
    elif what == "bin size":
        bin_.write_bytes(bin_.read_bytes() + b"\x00\x00")
    elif what == "vocab":
        write_corpus(prefix, [*docs()[:-1], [1, 2, VOCAB]])
    elif what == "few tokens":
        write_corpus(prefix, docs(n=2))


@pytest.mark.parametrize(("what", "file", "reason"), [
    ("missing idx", ".idx", "no such file"),
    ("missing bin", ".bin", "no such file"),
    ("magic", ".idx", "wrong magic"),
    ("version", ".idx", "wrong version 3: Megatron's indexed dataset is version 1"),
    ("idx size", ".idx", "counts disagree with the file's size"),
    ("bin size", ".bin", "counts disagree with the file's size"),
    ("vocab", ".bin", f"token id {VOCAB} (first at token 1952) is at or above the model's"
     f" vocabulary model.vocab({VOCAB})"),
    ("few tokens", ".bin", f"too few tokens: it holds 100, one global batch needs"
     f" train.global_batch(8) * model.seq_len(32) + 1 = {NEED}"),
])
def test_bad_corpora_are_refused_naming_file_and_reason(
        client: TestClient, root: Path, what: str, file: str, reason: str) -> None:
    prefix = root / "bad"
    _corrupt(prefix, what)
    loc, msg = refusal(submit(client, train=[{"path": str(prefix)}]))
    assert loc == ["body", "data", "train", "0", "path"]
    assert msg.startswith(f"{prefix}{file}: "), msg
    assert reason in msg, msg


def test_a_held_out_part_too_small_is_refused(client: TestClient, root: Path) -> None:
    write_corpus(root / "c", docs(n=12))  # 600 tokens; 1 document held out holds 50
    loc, msg = refusal(submit(client, train=[{"path": str(root / "c")}],
                              valid_fraction=0.05))
    assert loc == ["body", "data", "train", "0", "path"]
    assert "its held-out part (valid_fraction 0.05) holds 50" in msg, msg
    write_corpus(root / "v", docs(n=2))
    loc, msg = refusal(submit(client, train=[{"path": str(root / "c")}],
                              valid=[{"path": str(root / "v")}]))
    assert loc == ["body", "data", "valid", "0", "path"] and "too few tokens" in msg


def _train(**over: Any) -> dict[str, Any]:
    return {"steps": 6, "global_batch": 16, "micro_batch": 2, "precision": "fp32", **over}


@pytest.mark.parametrize(("train", "parallel", "loc", "words"), [
    (_train(batch_ramp={"start": 16, "increment": 4, "samples": 32}), None,
     ["body", "train", "batch_ramp", "start"], "start(16) is not below global_batch(16)"),
    (_train(batch_ramp={"start": 4, "increment": 8, "samples": 32}), None,
     ["body", "train", "batch_ramp", "increment"],
     "increment(8) does not divide global_batch(16) - start(4) = 12"),
    (_train(batch_ramp={"start": 4, "increment": 4, "samples": 0}), None,
     ["body", "train", "batch_ramp", "samples"], "greater than or equal to 1"),
    (_train(batch_ramp={"start": 4, "increment": 4}), None,
     ["body", "train", "batch_ramp", "samples"], "Field required"),
    (_train(batch_ramp={"start": 6, "increment": 2, "samples": 32}), None,
     ["body", "train", "batch_ramp", "start"],
     "start(6) is not divisible by micro_batch(2) * dp(2) = 4"),
    (_train(batch_ramp={"start": 4, "increment": 2, "samples": 32}), None,
     ["body", "train", "batch_ramp", "increment"],
     "increment(2) is not divisible by micro_batch(2) * dp(2) = 4"),
    (_train(batch_ramp={"start": 8, "increment": 4, "samples": 32}),
     {"tp": 1, "pp": 2, "dp": 1, "zero": 0, "virtual_stages": 2},
     ["body", "train", "batch_ramp"], "a batch ramp needs virtual_stages 1"),
])
def test_a_batch_ramp_is_refused_naming_its_field(client: TestClient, train: dict[str, Any],
                                                 parallel: dict[str, Any] | None,
                                                 loc: list[Any], words: str) -> None:
    over: dict[str, Any] = {"train": train}
    if parallel is not None:
        over["parallel"] = parallel
    got_loc, msg = refusal(client.post("/api/v1/jobs", json=tiny_spec(**over)))
    assert got_loc[:len(loc)] == loc and words in msg, (got_loc, msg)


def test_a_good_batch_ramp_is_accepted_and_ramps_as_megatrons(client: TestClient) -> None:
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator,
    )
    ramp = {"start": 8, "increment": 4, "samples": 50}
    r = client.post("/api/v1/jobs", json=tiny_spec(train=_train(batch_ramp=ramp)))
    assert r.status_code == 201, r.text
    t = JobSpec.model_validate(tiny_spec(train=_train(batch_ramp=ramp))).train
    megatron = RampupBatchsizeNumMicroBatchesCalculator(
        16, 2, 2, False, 0, ramp["start"], ramp["increment"], ramp["samples"])
    for consumed in range(0, 120):
        megatron.update(consumed, consistency_check=True)
        assert t.batch_at(consumed) == megatron.get_current_global_batch_size(), consumed
    assert {t.batch_at(c) for c in range(120)} == {8, 12, 16}
    assert JobSpec.model_validate(tiny_spec(train=_train())).train.batch_at(0) == 16


def chat_corpus(where: Path, copies: int = 40) -> str:
    """A chat corpus and its loss mask (`trident data prepare --chat`) at `where`."""
    from service.files.chat_prepare import prepare_chat
    from tests.tokenizer_folders import CONVERSATIONS, make, write_chats
    chats = write_chats(where.parent / f"{where.name}.jsonl", CONVERSATIONS * copies)
    prepare_chat([chats], str(make(where.parent / f"{where.name}-tok")), str(where))
    return str(where)


def test_kind_chat_needs_the_loss_mask_and_masks_documents(client: TestClient,
                                                           root: Path) -> None:
    prefix = chat_corpus(root / "sft")
    r = client.post("/api/v1/jobs", json=tiny_spec(data={"kind": "chat",
                                                         "train": [{"path": prefix}]}))
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["data"]["document_mask"] is True  # a chat job's default
    explicit = JobSpec.model_validate(tiny_spec(data={
        "kind": "chat", "train": [{"path": prefix}], "document_mask": False}))
    assert explicit.data.document_mask is False and explicit.data.corpora
    outside = chat_corpus(root.parent / "outside")  # a mask leading out of the data roots
    os.replace(prefix + "_loss_mask.bin", prefix + "_kept.bin")
    os.symlink(outside + "_loss_mask.bin", prefix + "_loss_mask.bin")
    loc, msg = refusal(client.post("/api/v1/jobs", json=tiny_spec(
        data={"kind": "chat", "train": [{"path": prefix}]})))
    assert loc == ["body", "data", "train", "0", "path"] and "_loss_mask.bin" in msg \
        and "outside the server's data roots" in msg, (loc, msg)
    os.remove(prefix + "_loss_mask.bin")
    os.replace(prefix + "_kept.bin", prefix + "_loss_mask.bin")
    os.remove(prefix + "_loss_mask.idx")
    loc, msg = refusal(client.post("/api/v1/jobs", json=tiny_spec(
        data={"kind": "chat", "train": [{"path": prefix}]})))
    assert loc == ["body", "data", "train", "0", "path"], loc
    assert "loss mask" in msg and "_loss_mask.idx" in msg
    loc, msg = refusal(client.post("/api/v1/jobs", json=tiny_spec(
        data={"kind": "chat", "train": [{"path": prefix}]},
        parallel={"tp": 1, "pp": 2, "dp": 1, "zero": 0})))
    assert loc == ["body", "parallel", "pp"] and "chat" in msg, (loc, msg)
