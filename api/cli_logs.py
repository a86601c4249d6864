"""`trident logs`: printing rank logs, whole lines prefixed with their rank, and following
them (the API's server-sent events) until the job ends."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import typer


class RankLines:
    """Whole lines of every rank, prefixed `[rank r]`; a partial line waits for its end."""

    def __init__(self) -> None:
        self.partial: dict[int, str] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        r = chunk["rank"]
        if chunk.get("skipped"):
            typer.echo(f"[rank {r}] ... {chunk['skipped']} bytes dropped by the size cap")
        *lines, self.partial[r] = (self.partial.get(r, "") + chunk["text"]).split("\n")
        for line in lines:
            typer.echo(f"[rank {r}] {line}")

    def flush(self) -> None:
        for r, rest in sorted(self.partial.items()):
            if rest:
                typer.echo(f"[rank {r}] {rest}")
        self.partial.clear()


def follow_rank_logs(client: httpx.Client, job_id: int, params: dict[str, Any],
                     fail: Callable[[str], Any]) -> None:
    """Print the stream of `GET /jobs/{id}/logs?follow=true` until the server ends it."""
    printer = RankLines()
    with client.stream("GET", f"/jobs/{job_id}/logs", params={**params, "follow": True},
                       timeout=None) as resp:
        if resp.status_code >= 400:
            resp.read()
            fail(f"{resp.status_code}: {resp.text}")
            return
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: {}":
                printer.add(json.loads(line[6:]))
    printer.flush()
