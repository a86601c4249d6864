"""Exports on a live `trident up` (issue 38): at most `TRIDENT_EXPORT_MAX_CONCURRENT` run at
once, one more is a 429 that `trident export` prints as one `error:` line (as it prints a
folder it cannot write); an export's folder is under the data directory, and one that a
`kill -9` of `trident up` left there is removed when the stack starts again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from service.contract.spec import ModelSpec
from service.files.checkpoint_dirs import default_folder
from service.files.checkpoint_tags import MARKER, tag
from service.planner.shape import ModelShape
from tests.servers import HTTP, ROOT, free_port
from tests.up import Up
from workers.checkpoint.tag_forms import LAYOUT
from workers.modeling.model import GPT

pytestmark = pytest.mark.slow

MODEL = {"layers": 1, "hidden": 256, "heads": 4, "kv_heads": 2, "vocab": 32000, "seq_len": 16,
         "activation": "swiglu"}
"""65 MB of fp32 weights: more than the loopback's socket buffers hold, so an export whose
client reads nothing stays in flight."""
STEP = 1000


def _job_with_tag(up: Up) -> tuple[int, dict[str, torch.Tensor]]:
    """A job (cancelled at once: only its record and folder matter) with a complete tp 1
    tag of step STEP in its default checkpoint folder; the tag's weights."""
    r = HTTP.post(f"{up.server}/api/v1/jobs", headers=up.auth, json={
        "name": "export", "model": MODEL,
        "train": {"steps": 2, "global_batch": 2, "micro_batch": 2, "precision": "fp32"},
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 0},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5}})
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    assert HTTP.post(f"{up.server}/api/v1/jobs/{job}/cancel",
                     headers=up.auth).status_code == 202
    weights = GPT(ModelShape.from_spec(ModelSpec(**MODEL)), 3).state_dict()
    folder = default_folder(up.data_dir / "checkpoints", job) / tag(STEP)
    folder.mkdir(parents=True)
    torch.save({"module": weights}, folder / "mp_rank_00_model_states.pt")
    (folder / LAYOUT).write_text(json.dumps({"tp": 1, "pp": 1, "dp": 1, "zero": 0}))
    (folder / MARKER).write_text(f"{STEP}\n")
    return job, weights


def _open(up: Up, job: int) -> httpx.Response:
    """An export whose answer has begun (its status and headers), its body not read."""
    client = httpx.Client(timeout=httpx.Timeout(10, read=300))
    return client.send(client.build_request(
        "GET", f"{up.server}/api/v1/jobs/{job}/export", params={"step": STEP},
        headers=up.auth), stream=True)


def _cli(up: Up, *args: str) -> subprocess.CompletedProcess[str]:
    token = (up.data_dir / "admin.token").read_text().strip()
    return subprocess.run([sys.executable, "-m", "cli.main", *args, "--server", up.server],
                          env={**os.environ, "PYTHONPATH": str(ROOT), "TRIDENT_TOKEN": token},
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def _slot_folders(data_dir: Path) -> list[str]:
    return sorted(p.name for p in (data_dir / "exports").iterdir() if p.is_dir())


def test_exports_are_bounded_refused_in_one_line_and_swept_after_a_kill(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    scratch = Path(tempfile.mkdtemp(prefix="tx-"))  # short: Ray's socket paths go in it
    env = {"TRIDENT_EXPORT_MAX_CONCURRENT": "2", "TMPDIR": str(scratch)}
    up = Up(data, free_port(), env)
    held: list[httpx.Response] = []
    try:
        up.wait_healthy()
        job, weights = _job_with_tag(up)
        held = [_open(up, job), _open(up, job)]
        assert [r.status_code for r in held] == [200, 200]
        assert _slot_folders(data) == ["slot-0", "slot-1"]
        # the third is refused while both are in flight, as a 429 and as one CLI line
        r = HTTP.get(f"{up.server}/api/v1/jobs/{job}/export", params={"step": STEP},
                     headers=up.auth)
        assert r.status_code == 429 and r.headers["Retry-After"] == "10", r.text
        assert "TRIDENT_EXPORT_MAX_CONCURRENT" in r.json()["detail"]
        out = tmp_path / "model"
        cli = _cli(up, "export", str(job), "--step", str(STEP), "--out", str(out))
        assert cli.returncode == 2 and cli.stdout == "", cli
        assert cli.stderr == f"error: 429: {r.json()['detail']}\n"
        assert not out.exists()
        # a folder the CLI cannot write: one line naming it
        (tmp_path / "file").write_text("")
        cli = _cli(up, "export", str(job), "--out", str(tmp_path / "file" / "model"))
        assert cli.returncode == 2 and cli.stdout == "", cli
        assert cli.stderr == f"error: --out {tmp_path}/file/model: Not a directory" \
            f" ({tmp_path}/file)\n"

        # a client that goes away frees its slot: the next export is taken and sent whole
        held.pop(0).close()
        deadline = time.monotonic() + 60
        while (cli := _cli(up, "export", str(job), "--out", str(out))).returncode != 0:
            assert "export(s) are running" in cli.stderr and time.monotonic() < deadline, cli
            time.sleep(0.5)
        assert cli.stdout == f"job {job}: {out}\n", cli
        got = load_file(out / "model.safetensors")
        assert torch.equal(got["model.embed_tokens.weight"], weights["layers.0.tok"])
        assert torch.equal(got["lm_head.weight"], weights["layers.2.weight"])
        assert _slot_folders(data) == ["slot-0"] or _slot_folders(data) == ["slot-1"]
        assert not [p for p in scratch.iterdir() if "export" in p.name]  # the system's temp

        # kill -9 of `trident up` with an export in flight: its folder stays behind ...
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait(10)
        held.pop().close()
        up.stop()
        [stale] = _slot_folders(data)
        assert list((data / "exports" / stale).iterdir()) == [
            data / "exports" / stale / f"job-{job}-step{STEP}-hf"]
        # ... until the stack starts again
        up = Up(data, free_port(), env)
        up.wait_healthy()
        assert _slot_folders(data) == []
        assert "removed 1 stale export folder(s)" in up.log(), up.log()
    finally:
        for r in held:
            r.close()
        up.stop()
        shutil.rmtree(scratch, ignore_errors=True)
