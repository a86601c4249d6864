"""One Ray actor per rank: runs the per-rank trainer on a thread and answers polls.

Training runs on a thread so that the actor always answers `poll`, `cancel` and `info` even
in the middle of a long step or a stuck collective. Created by `workers.group.RayWorkerGroup`.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
import traceback
from typing import Any

import ray


@ray.remote
class RankActor:
    def __init__(self, rank: int, world_size: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.rank = rank
        self.world_size = world_size
        self._reports: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._finished = False

    def info(self) -> dict[str, Any]:
        """Where this rank landed, and a free port in case it is the rendezvous rank."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "free_port": port,
        }

    def start(self, spec_json: dict[str, Any], master_addr: str, master_port: int,
              local_rank: int, checkpoint_dir: str | None, attempt: int) -> None:
        from service.spec import JobSpec
        from workers.train import RankContext, train_rank

        spec = JobSpec.model_validate(spec_json)
        ctx = RankContext(rank=self.rank, world_size=self.world_size, local_rank=local_rank,
                          master_addr=master_addr, master_port=master_port,
                          checkpoint_dir=checkpoint_dir, attempt=attempt)

        def run() -> None:
            try:
                train_rank(spec, ctx, self._reports.put, self._stop)
            except BaseException:  # reported as data; the controller applies the policy
                self._error = traceback.format_exc()
            finally:
                self._finished = True

        self._thread = threading.Thread(target=run, name=f"rank{self.rank}", daemon=True)
        self._thread.start()

    def poll(self) -> dict[str, Any]:
        reports = []
        while True:
            try:
                reports.append(self._reports.get_nowait())
            except queue.Empty:
                break
        if not self._finished:
            state = "running"
        elif self._error:
            state = "failed"
        else:
            state = "stopped" if self._stop.is_set() else "succeeded"
        return {"rank": self.rank, "state": state, "reports": reports, "error": self._error,
                "time": time.time()}

    def cancel(self) -> None:
        self._stop.set()
