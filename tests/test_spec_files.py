"""Files a spec names cannot stop the API (`service.contract.specfiles`,
`api.deps.read_hf_configs`):
a `model.hf_config` that is a FIFO, a read that hangs, a config nested half a million deep,
each against a served app whose `/healthz` keeps answering; and `init.from_hf` is confined as
`checkpoint.dir` is, at submission
(`service.files.checkpoint_dirs.CheckpointPlaces.read_refusal`)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import GPT2Config

from api.app import create_app
from service.contract import specfiles
from service.files.checkpoint_dirs import CheckpointWriter, claim
from service.settings import Settings
from service.store import Store
from tests.conftest import tiny_spec, user_token
from tests.servers import serving

GPT2 = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32).to_dict()


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    """A data directory and a checkpoint root of its own."""
    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    data.mkdir()
    ckpt.mkdir()
    return data, ckpt


@pytest.fixture
def served(store: Store, roots: tuple[Path, Path]) -> Iterator[tuple[str, dict[str, str]]]:
    """A served app on `roots` (reads time out after 1 s), and a member's headers."""
    data, ckpt = roots
    settings = Settings(data_dir=data, checkpoint_roots=str(ckpt), spec_file_read_s=1.0)
    with serving(create_app(settings, store=store)) as url:
        yield url, {"Authorization": f"Bearer {user_token(store, 'alice', 'member')}"}


def hf_spec(path: str) -> dict[str, Any]:
    return tiny_spec(model={"hf_config": path, "seq_len": 16})


def healthz_answers(url: str) -> None:
    r = httpx.get(f"{url}/api/v1/healthz", timeout=3)
    assert r.status_code in (200, 503), r.text  # 503: no controller holds the lease here
    assert r.json()["database"] == "ok"


def post_while_healthz_answers(url: str, headers: dict[str, str], route: str,
                               body: dict[str, Any]) -> httpx.Response:
    """`body` posted to `route` (in a thread, with a timeout), and `/healthz` asked while that
    request is under way; the post's answer."""
    with ThreadPoolExecutor(1) as pool:
        posted = pool.submit(httpx.post, f"{url}/api/v1{route}", json=body, headers=headers,
                             timeout=10)
        healthz_answers(url)
        return posted.result()


def refused_field(r: httpx.Response, field: list[str]) -> str:
    assert r.status_code == 422, r.text
    (error,) = [e for e in r.json()["detail"] if e["loc"][1:] == field]
    return str(error["msg"])


def test_a_fifo_named_as_hf_config_is_refused_while_healthz_answers(
        served: tuple[str, dict[str, str]], roots: tuple[Path, Path]) -> None:
    url, headers = served
    folder = roots[1] / "llama"
    folder.mkdir()
    fifo = folder / "config.json"
    os.mkfifo(fifo)
    try:
        for route in ("/jobs", "/plan"):
            r = post_while_healthz_answers(url, headers, route, hf_spec(str(folder)))
            msg = refused_field(r, ["model", "hf_config"])
            assert "a FIFO, not a regular file" in msg and str(fifo) in msg
        healthz_answers(url)
    finally:  # the code before opened it on the event loop: a writer lets it go
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"{}")
            os.close(fd)
        except OSError:
            pass  # nothing waits on it


def test_a_read_that_hangs_is_refused_after_the_time_limit(
        served: tuple[str, dict[str, str]], roots: tuple[Path, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that does not answer (a hung mount: its `stat` waits until released)."""
    url, headers = served
    (roots[1] / "config.json").write_text(json.dumps(GPT2))
    released = threading.Event()
    real = specfiles.open_regular

    def hung(path: str) -> int:
        released.wait(30)
        return real(path)

    monkeypatch.setattr(specfiles, "open_regular", hung)
    try:
        r = post_while_healthz_answers(url, headers, "/jobs", hf_spec(str(roots[1])))
        msg = refused_field(r, ["model", "hf_config"])
        assert "not read within 1 s (TRIDENT_SPEC_FILE_READ_S)" in msg
    finally:
        released.set()


def test_a_config_nested_half_a_million_deep_is_a_422_naming_the_field(
        served: tuple[str, dict[str, str]], roots: tuple[Path, Path]) -> None:
    url, headers = served
    deep = roots[1] / "deep.json"
    deep.write_text("[" * 500_000 + "]" * 500_000)
    big = roots[1] / "big.json"
    big.write_text(json.dumps({**GPT2, "padding": "x" * (1 << 20)}))
    for route in ("/jobs", "/plan"):
        r = httpx.post(f"{url}/api/v1{route}", json=hf_spec(str(deep)), headers=headers,
                       timeout=10)
        assert "JSON nested deeper than the parser reads" in refused_field(
            r, ["model", "hf_config"])
        r = httpx.post(f"{url}/api/v1{route}", json=hf_spec(str(big)), headers=headers,
                       timeout=10)
        assert f"larger than the {1 << 20} read (TRIDENT_SPEC_FILE_MAX_BYTES)" in \
            refused_field(r, ["model", "hf_config"])
    healthz_answers(url)


def test_init_from_hf_is_confined_like_checkpoint_dir_at_submission(
        store: Store, tmp_path: Path) -> None:
    """Default roots (the data directory): not the data directory, not another job's default
    folder, not a folder recorded as a job's; through a resubmission's `set` too."""
    settings = Settings(data_dir=tmp_path)
    with serving(create_app(settings, store=store)) as url:
        headers = {"Authorization": f"Bearer {user_token(store, 'carol', 'member')}"}
        alices = {"Authorization": f"Bearer {user_token(store, 'alice', 'member')}"}
        r = httpx.post(f"{url}/api/v1/jobs", json=tiny_spec(), headers=alices, timeout=10)
        assert r.status_code == 201, r.text
        job = r.json()["id"]
        default = tmp_path / "checkpoints" / f"job-{job}"
        default.mkdir(parents=True)
        named = tmp_path / "checkpoints" / "alice-run"
        claim(named, CheckpointWriter(job_id=job, owner="alice"))
        (named / "hf").mkdir()
        mine = tmp_path / "checkpoints" / "carols-model"
        mine.mkdir()
        for folder, why in ((tmp_path, "the data directory"),
                            (default, f"the default checkpoint folder of job {job}"),
                            (named / "hf", f"the checkpoint folder of job {job} (owner alice)")):
            r = httpx.post(f"{url}/api/v1/jobs", json=tiny_spec(init={"from_hf": str(folder)}),
                           headers=headers, timeout=10)
            assert why in refused_field(r, ["init", "from_hf"]), r.text
        r = httpx.post(f"{url}/api/v1/jobs", json=tiny_spec(init={"from_hf": str(mine)}),
                       headers=headers, timeout=10)
        assert r.status_code == 201, r.text
        r = httpx.post(f"{url}/api/v1/jobs/{r.json()['id']}/resubmit",
                       json={"set": {"init.from_hf": str(named)}}, headers=headers,
                       timeout=10)
        assert f"holds the checkpoints of job {job} (owner alice)" in refused_field(
            r, ["init", "from_hf"])
