"""The orchestration comparison's plain-Ray sides: the trainer torchrun runs
(`workers.trainer.train`'s main, the same spec and ranks) in two plain Ray actors on a Ray head of
this process's own, with nothing of Trident around it (no API, controller, monitor, rank log
or reports).

- `inproc`: each actor runs the trainer in its own process, as Trident's rank actors do. Its
  speed against torchrun is what Ray's worker processes and its head cost the ranks by
  themselves; Trident's against it is what Trident adds.
- `child`: each actor starts the trainer as a child process (`python -m workers.trainer.train`) and
  waits for it, as torchrun's agent does: the ranks run with Ray's head beside them but no
  Ray in their own processes. Against `inproc`, what Ray's runtime inside a rank's process
  costs it.

Each actor takes one CPU; the trainer gets torchrun's environment (rank, world size, master
address and port, one OpenMP thread) and its output is captured; rank 0's step lines are
printed to stdout, as torchrun's rank 0 prints them. Ray's workers start at niceness 0, as
torchrun's ranks and Trident's do (Ray's own default, 15, would measure that instead:
`workers.rank.actor.RANK_RUNTIME_ENV`).

Usage: python bench/_ray_ranks.py inproc|child SPEC_JSON PORT
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
MODES = ("inproc", "child")


def torchrun_env(rank: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
            "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}


class Rank:
    """A plain actor (`ray.remote(num_cpus=1)` in `main`), as Trident's rank actors are."""

    def train(self, mode: str, spec_path: str, rank: int, port: int) -> str:
        if mode == "child":
            return in_child(spec_path, rank, port)
        return in_process(spec_path, rank, port)


def in_process(spec_path: str, rank: int, port: int) -> str:
    """One rank of `workers.trainer.train` in this process: its stdout."""
    os.environ.update(torchrun_env(rank, port))
    sys.argv = ["workers.trainer.train", "--spec", spec_path]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("workers.trainer.train", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise RuntimeError(f"rank {rank} exited {exc.code}: {out.getvalue()[-2000:]}"
                                   ) from None
    return out.getvalue()


def in_child(spec_path: str, rank: int, port: int) -> str:
    """One rank of `workers.trainer.train` in a child process: its stdout."""
    done = subprocess.run([sys.executable, "-m", "workers.trainer.train", "--spec", spec_path],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **torchrun_env(rank, port),
                               "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"rank {rank} exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def main(argv: list[str]) -> int:
    import ray

    from service.cluster.rayhead import WORKER_NICENESS_ENV

    mode, spec_path, port = argv[0], argv[1], int(argv[2])
    if mode not in MODES:
        raise SystemExit(f"mode: one of {MODES}, not {mode!r}")
    os.environ.update(WORKER_NICENESS_ENV)  # read by the head this starts, and its workers
    ray.init(address="local", num_cpus=WORLD, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    try:
        actor = ray.remote(num_cpus=1)(Rank)
        ranks = [actor.remote() for _ in range(WORLD)]
        outs = ray.get([a.train.remote(mode, spec_path, r, port)
                        for r, a in enumerate(ranks)])
    finally:
        ray.shutdown()
    sys.stdout.write(outs[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
