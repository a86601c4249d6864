"""Helper for the monitor's multi-process gloo tests: run a function on N spawned ranks."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests import forked
from tests.servers import free_port


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
    """Run `fn(rank, world, *args)` on `world` gloo ranks (`tests.forked`); return each rank's
    JSON result."""
    ctx = forked.context()
    port = free_port()
    procs = [forked.process(ctx, _entry, (r, fn, world, port, str(out), args))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    assert not failed, f"ranks failed (rank: exit code): {failed}"
    return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
