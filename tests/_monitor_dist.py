"""Helper for the monitor's multi-process gloo tests: run a function on N spawned ranks."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # DeepSpeed reads these
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, out: Path, *args: Any) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; return each rank's JSON result."""
    mp.spawn(_entry, args=(fn, world, free_port(), str(out), args), nprocs=world, join=True)
    return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
