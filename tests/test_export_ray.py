"""An export as a Ray task (issue 44, point 3), on the test process's Ray (`local_ray`): the
controller's runner (`service.control.export_run`) runs `workers.launch.export_task.ray_export`,
whose task requests one CPU and the memory of one shard and one tensor, prefers the node of
the job's rank 0, and writes the sharded folder that the API then lists and serves file by
file; an export that needs more memory than any node has is refused naming the size, before
any task is placed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

import ray  # noqa: E402
import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from api.app import create_app  # noqa: E402
from service.files.checkpoint_tags import MARKER, tag  # noqa: E402
from service.files.export import ExportWork  # noqa: E402
from service.planner.shape import ModelShape  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.store import Store  # noqa: E402
from tests.conftest import tiny_spec, user_token  # noqa: E402
from tests.export_runs import running_exports  # noqa: E402
from workers.checkpoint.tag_forms import LAYOUT  # noqa: E402
from workers.launch.export_task import options, ray_export  # noqa: E402
from workers.modeling.model import GPT  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_export_task_writes_the_sharded_folder_the_api_serves(
        local_ray: None, tmp_path: Path, sqlite_store: Store) -> None:
    settings = Settings(data_dir=tmp_path / "data", checkpoint_roots=str(tmp_path),
                        export_roots=str(tmp_path / "exports"))
    with TestClient(create_app(settings, store=sqlite_store)) as c, \
            running_exports(sqlite_store, ray_export) as runner:
        c.headers["Authorization"] = f"Bearer {user_token(sqlite_store, 'alice', 'member')}"
        r = c.post("/api/v1/jobs", json=tiny_spec(
            checkpoint={"dir": str(tmp_path / "job")},
            model={"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64,
                   "seq_len": 16, "activation": "swiglu"}))
        assert r.status_code == 201, r.text
        job = r.json()["id"]
        shape = ModelShape.from_spec(sqlite_store.get_job(job_id=job).spec.model)
        weights = GPT(shape, 5).state_dict()
        path = tmp_path / "job" / tag(4)
        path.mkdir(parents=True)
        torch.save({"module": weights}, path / "mp_rank_00_model_states.pt")
        (path / LAYOUT).write_text(json.dumps({"tp": 1, "pp": 1, "dp": 1, "zero": 0}))
        (path / MARKER).write_text("4\n")
        # the rank 0 node the runner would prefer: this Ray's one node
        node = ray.nodes()[0]["NodeID"]
        url = f"/api/v1/jobs/{job}/exports"
        asked = c.post(url, json={"max_shard_size": "8KB"}).json()
        deadline = time.monotonic() + 300
        while (rec := c.get(f"{url}/{asked['id']}").json())["state"] in ("pending", "running"):
            assert time.monotonic() < deadline, rec
            time.sleep(0.2)
        assert rec["state"] == "done", rec["error"]
        listed = c.get(f"{url}/{rec['id']}/files").json()["items"]
        names = [f["name"] for f in listed]
        assert "model.safetensors.index.json" in names and len(names) > 4, names
        folder = Path(rec["destination"])
        assert folder == tmp_path / "exports" / "alice" / f"job-{job}-step4"
        for f in listed:  # one GET a file, the bytes of the folder's file
            got = c.get(f"{url}/{rec['id']}/files/{f['name']}")
            assert got.status_code == 200 and got.content == (folder / f["name"]).read_bytes()
            assert int(got.headers["content-length"]) == f["bytes"]
        assert rec["bytes"] == sum(f["bytes"] for f in listed)
        embed = next(load_file(folder / n)["model.embed_tokens.weight"] for n in names
                     if n.endswith(".safetensors")
                     and "model.embed_tokens.weight" in load_file(folder / n))
        assert torch.equal(embed, weights["layers.0.tok"])
        work = runner.work(asked["id"], job, 4, rec["destination"], rec["max_shard_bytes"])
    # what Ray was asked for: one CPU, one shard and one tensor of memory
    opts = options(ExportWork(**{**work.to_json(), "node_id": node}))
    assert opts["num_cpus"] == 1 and opts["memory"] == work.memory_bytes()
    assert work.memory_bytes() < 8_000 + 2 * 4 * shape.vocab * shape.hidden + (257 << 20)
    assert opts["scheduling_strategy"].node_id == node and opts["scheduling_strategy"].soft
    # more memory than any node has: refused before a task is placed, naming the size
    huge = ExportWork(**{**work.to_json(), "max_shard_bytes": 1 << 50,
                         "shape": {**work.shape, "vocab": 1 << 24, "hidden": 1 << 16}})
    done = ray_export(huge)
    assert done.refused is not None and "smaller --max-shard-size" in done.refused
