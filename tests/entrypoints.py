"""Custom per-rank entry points for the end-to-end tests (`tests.entrypoints:NAME`)."""

from __future__ import annotations

from typing import Any


def explode(ctx: Any) -> None:
    if ctx.rank == 1:
        raise RuntimeError("rank 1 exploded on purpose")
