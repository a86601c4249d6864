"""DeepSpeed is imported without MLflow (`workers.runtime.deepspeed_import`): a rank's process does
not pay for MLflow's import, which DeepSpeed's autotuner tries and Trident never uses, and MLflow
stays importable afterwards for whoever wants it; and DeepSpeed's CPU shared-memory op is never
built (a compile under a lock file that a killed rank leaves behind); and DeepSpeed's Muon
modules are stand-ins, so that no rank imports torch's inductor for kernels it never runs."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_ranks_imports_leave_mlflow_out_and_importable() -> None:
    code = (
        "import sys\n"
        "import workers.trainer.train\n"
        "print('mlflow' in sys.modules)\n"
        "from deepspeed.autotuning import autotuner\n"
        "print(autotuner.has_mlflow)\n"
        "import mlflow\n"
        "print(mlflow.MlflowClient.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True).stdout.splitlines()[-3:]
    assert out == ["False", "False", "MlflowClient"], out


def _deepspeed_at_top(tree: ast.Module) -> list[str]:
    """The module-level imports that name DeepSpeed or the helper, in order."""
    out = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [n for n in names if n.split(".")[0] == "deepspeed"
                or n == "workers.runtime.deepspeed_import"]
    return out


def test_the_workers_modules_import_deepspeed_through_the_helper_first() -> None:
    for path in sorted((ROOT / "workers").glob("*.py")):
        seen = _deepspeed_at_top(ast.parse(path.read_text()))
        if seen and path.name != "deepspeed_import.py":
            assert seen[0] == "workers.runtime.deepspeed_import", (path.name, seen)


def test_the_check_sees_a_direct_import() -> None:
    tree = ast.parse("import os\nfrom deepspeed.pipe import PipelineModule\n"
                     "from workers.runtime.deepspeed_import import deepspeed\n")
    assert _deepspeed_at_top(tree) == ["deepspeed.pipe", "workers.runtime.deepspeed_import"]


def one_cpu_rank(tmp_path: Path, body: str, **env: str) -> tuple[str, Path]:
    """Run `body` as rank 0 of 1 (gloo, DeepSpeed on the CPU, DeepSpeed taken from the helper)
    in a process of its own, with an extensions folder of the test's: its stdout, and that
    folder (absent unless something was compiled)."""
    code = ("import sys, torch, torch.distributed as dist\n"
            "from workers.runtime.deepspeed_import import deepspeed\n"
            f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'rdzv'}',"
            " rank=0, world_size=1)\n" + body)
    extensions = tmp_path / "torch_extensions"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions),
                              "DS_ACCELERATOR": "cpu", **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout, extensions


def test_a_cpu_ranks_deepspeed_backend_builds_no_shared_memory_op(tmp_path: Path) -> None:
    """DeepSpeed's communication backend on a CPU rank comes up without its shared-memory
    all-reduce: nothing is compiled into (or locked in) the torch extensions folder, and the
    all-reduce is `torch.distributed`'s."""
    out, extensions = one_cpu_rank(tmp_path, (
        "deepspeed.init_distributed(dist_backend='gloo')\n"
        "from deepspeed import comm\n"
        "print(comm.comm.cdb.shm_comm_op is None)\n"
        "x = torch.ones(4)\n"
        "comm.inference_all_reduce(x)\n"
        "print(x.tolist())\n"))
    assert out.splitlines()[-2:] == ["True", "[1.0, 1.0, 1.0, 1.0]"], out
    assert "built successfully" not in out
    assert not extensions.exists() or not any(extensions.rglob("*shm*")), \
        sorted(extensions.rglob("*"))


def test_zero_steps_run_without_muons_kernels_or_torchs_inductor(tmp_path: Path) -> None:
    """ZeRO 1-3 engines check for DeepSpeed's Muon in `initialize` and in every step; on a rank
    they find the stand-ins, so torch's inductor compiler (`torch._inductor.compile_fx`, which
    Muon's `torch.compile`d kernels import; with the real modules it is imported by
    `initialize`) is never imported, and the steps train as before (the loss falls)."""
    # torch's AdamW, as Trident's CPU ranks use (`service.contract.ds_config`): DeepSpeed's own
    # would compile its fused op into the extensions folder first.
    out, extensions = one_cpu_rank(tmp_path, (
        "for stage in (1, 2, 3):\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))\n"
        "    cfg = {'train_batch_size': 4, 'zero_optimization': {'stage': stage},\n"
        "           'optimizer': {'type': 'AdamW', 'params': {'lr': 0.01, 'torch_adam': True}}}\n"
        "    engine, *_ = deepspeed.initialize(model=model, config=cfg,\n"
        "                                      model_parameters=model.parameters())\n"
        "    x, y = torch.randn(4, 8), torch.randn(4, 1)\n"
        "    losses = []\n"
        "    for _ in range(5):\n"
        "        loss = torch.nn.functional.mse_loss(engine(x), y)\n"
        "        engine.backward(loss)\n"
        "        engine.step()\n"
        "        losses.append(loss.item())\n"
        "    print(stage, losses[-1] < losses[0])\n"
        "print('torch._inductor.compile_fx' in sys.modules)\n"
        "from deepspeed.runtime.zero.muon import original_muon\n"
        "print(original_muon.__doc__)\n"), LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    assert out.splitlines()[-5:] == [
        "1 True", "2 True", "3 True", "False",
        "DeepSpeed's Muon, never used by Trident's ranks (workers.runtime.deepspeed_import)."], \
        out[-3000:]
    assert not extensions.exists(), sorted(extensions.rglob("*"))
