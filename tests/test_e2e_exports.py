"""Exports on a live `trident up` (issue 44, point 3): `trident export` has the controller run
the export as a Ray task on the stack's cluster, which writes Hugging Face's sharded folder
under the export root (`TRIDENT_EXPORT_ROOTS`), in the job owner's folder; the API records
where it went and its size (`trident export --list`), and `--out` downloads it file by file:
the same bytes, loaded by `transformers` with the tag's weights. A destination outside the
roots is one `error:` line naming the field."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from service.contract.spec import ModelSpec
from service.files.checkpoint_dirs import default_folder
from service.files.checkpoint_tags import MARKER, tag
from service.planner.shape import ModelShape
from tests.servers import HTTP, ROOT, free_port
from tests.up import Up
from workers.checkpoint.tag_forms import LAYOUT
from workers.modeling.model import GPT

pytestmark = pytest.mark.slow

MODEL = {"layers": 1, "hidden": 128, "heads": 4, "kv_heads": 2, "vocab": 4000, "seq_len": 16,
         "activation": "swiglu"}
"""5 MB of fp32 weights: in shards of at most 1MB, three shards (the embedding and the head
each alone) and an index."""
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


def _cli(up: Up, *args: str) -> subprocess.CompletedProcess[str]:
    token = (up.data_dir / "admin.token").read_text().strip()
    return subprocess.run([sys.executable, "-m", "cli.main", *args, "--server", up.server],
                          env={**os.environ, "PYTHONPATH": str(ROOT), "TRIDENT_TOKEN": token},
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_an_export_is_a_ray_task_of_the_stack_and_downloads_file_by_file(
        tmp_path: Path) -> None:
    data, roots = tmp_path / "data", tmp_path / "exports"
    data.mkdir()
    scratch = Path(tempfile.mkdtemp(prefix="tx-"))  # short: Ray's socket paths go in it
    up = Up(data, free_port(), {"TRIDENT_EXPORT_ROOTS": str(roots), "TMPDIR": str(scratch)})
    try:
        up.wait_healthy()
        job, weights = _job_with_tag(up)
        out = tmp_path / "model"
        cli = _cli(up, "export", str(job), "--step", str(STEP), "--max-shard-size", "1MB",
                   "--out", str(out))
        assert cli.returncode == 0, (cli, up.log())
        assert cli.stdout == f"job {job}: {out}\n", cli
        assert f"export 1 of job {job}: Ray task" in up.log(), up.log()

        written = roots / "admin" / f"job-{job}-step{STEP}"
        names = sorted(p.name for p in written.iterdir())
        assert sorted(p.name for p in out.iterdir()) == names
        shards = [n for n in names if n.startswith("model-")]
        assert len(shards) >= 3 and "model.safetensors.index.json" in names, names
        assert all((out / n).read_bytes() == (written / n).read_bytes() for n in names)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == shards
        got: dict[str, torch.Tensor] = {}
        for shard in shards:
            got.update(load_file(out / shard))
        assert torch.equal(got["model.embed_tokens.weight"], weights["layers.0.tok"])
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        assert torch.equal(loaded["model.embed_tokens.weight"], weights["layers.0.tok"])
        assert torch.equal(loaded["lm_head.weight"], weights["layers.2.weight"])
        assert torch.equal(loaded["model.layers.0.mlp.down_proj.weight"],
                           weights["layers.1.down.weight"])

        listed = _cli(up, "export", str(job), "--list", "-o", "json")
        assert listed.returncode == 0, listed
        [rec] = json.loads(listed.stdout)["items"]
        assert (rec["state"], rec["destination"], rec["step"]) == ("done", str(written), STEP)
        assert rec["bytes"] == sum((written / n).stat().st_size for n in names)
        assert sorted(rec["files"]) == names

        # a destination outside the export roots: one line naming the field
        cli = _cli(up, "export", str(job), "--dest", str(tmp_path / "elsewhere"))
        assert cli.returncode == 2 and cli.stdout == "", cli
        assert cli.stderr.startswith("error: ") and "destination: " in cli.stderr, cli
        assert len(cli.stderr.splitlines()) == 1 and not (tmp_path / "elsewhere").exists()
    finally:
        up.stop()
        shutil.rmtree(scratch, ignore_errors=True)
