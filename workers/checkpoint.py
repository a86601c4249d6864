"""DeepSpeed checkpoints of a job: save every `checkpoint.every_steps`, resume from the newest
complete one; before any rank resumes, rank 0 makes the folder the job's own (`claim_folder`,
`service.checkpoints`): a folder another job wrote is neither resumed from nor written into.

Layout: `<dir>/step<N>/` is one DeepSpeed tag (model and ZeRO shards of every rank, written by
the engine) plus a `COMPLETE` marker that rank 0 writes (atomically: a temporary file renamed)
once every rank has finished writing. A tag without the marker (a rank died mid-save) is ignored
on resume. The data position is the step itself (see `workers.data`); it is stored with the RNG
states in DeepSpeed's client state.

A save the disk refuses (full, a quota, an I/O error) costs that tag only: each rank's writes
are made with their errors held (`_writes_held`), so a rank whose write failed still goes
through the save's collectives with its peers; then the ranks share their errors, and when any
failed rank 0 removes the partial tag instead of marking it. Every rank gets the reason back,
the newest complete tag stays the one to resume from, and training goes on: the next save is
tried at its step.

Called by `workers.train`; `newest_complete_step` also by custom entrypoints.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from service.checkpoints import CheckpointRefused, CheckpointWriter, claim

MARKER = "COMPLETE"
_TAG = re.compile(r"^step(\d+)$")


def tag(step: int) -> str:
    return f"step{step}"


def newest_complete_step(directory: str | None) -> int:
    """The step of the newest complete checkpoint under `directory`, 0 when there is none."""
    if not directory or not os.path.isdir(directory):
        return 0
    steps = [int(m.group(1)) for name in os.listdir(directory) if (m := _TAG.match(name))
             and os.path.exists(os.path.join(directory, name, MARKER))]
    return max(steps, default=0)


def agreed_resume_step(directory: str | None) -> int:
    """`newest_complete_step` as rank 0 sees it, so every rank loads the same tag."""
    step = [newest_complete_step(directory) if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(step, src=0)
    return int(step[0])


def claim_folder(directory: str | None, writer: CheckpointWriter | None) -> None:
    """Collective: rank 0 makes `directory` `writer`'s job's (`service.checkpoints.claim`);
    every rank raises CheckpointRefused when it is another job's, so that none resumes from
    it or writes into it. Nothing is checked without a directory or a writer."""
    if directory is None or writer is None:
        return
    verdict: list[tuple[str, str] | None] = [None]
    if dist.get_rank() == 0:
        try:
            claim(directory, writer)
        except (CheckpointRefused, OSError) as exc:
            verdict = [(type(exc).__name__, str(exc))]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        kind, why = verdict[0]
        raise CheckpointRefused(why) if kind == "CheckpointRefused" else \
            OSError(f"rank 0 could not claim checkpoint folder {directory}: {why}")


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Saved(NamedTuple):
    """What `save` did, the same on every rank."""

    path: str | None
    """The complete tag's directory (None: the save failed)."""
    error: str | None
    """Why the tag was not saved: each failing rank's first error (None: it was saved)."""


class _Held:
    """The first error of a rank's checkpoint writes, held instead of raised."""

    def __init__(self) -> None:
        self.error: str | None = None

    def run(self, path: str, write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """`write(*args, **kwargs)`, which writes `path`."""
        if self.error is not None:  # the tag is lost already: spare the disk
            return
        try:
            write(*args, **kwargs)
        except (OSError, RuntimeError) as exc:  # torch.save's zip writer raises RuntimeError
            self.error = f"writing {path}: {type(exc).__name__}: {exc}{_free(path)}"


def _free(path: str) -> str:
    """The free space where `path` goes, which torch's own errors leave out (`unexpected
    pos 3712 vs 3604` is how its zip writer says the disk is full)."""
    where = path
    while where and not os.path.isdir(where):
        where = os.path.dirname(where)
    try:
        st = os.statvfs(where or ".")
    except OSError:
        return ""
    return f" ({st.f_bavail * st.f_frsize / 2**20:.1f} MiB free on its filesystem)"


class _HeldEngine:
    """DeepSpeed's checkpoint engine, its writes (`save`, `makedirs`) through `_Held`."""

    def __init__(self, engine: Any, held: _Held) -> None:
        self._engine = engine
        self._held = held

    def save(self, state_dict: Any, path: str) -> None:
        self._held.run(path, self._engine.save, state_dict, path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._held.run(path, self._engine.makedirs, path, exist_ok=exist_ok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@contextmanager
def _writes_held(engine: Any) -> Iterator[_Held]:
    """DeepSpeed's engine with every write of `save_checkpoint` held: its shards go through
    `checkpoint_engine`, so that the collectives between them (its barriers, the tag check)
    still run on every rank. Global rank 0 also copies DeepSpeed's recovery scripts
    (`zero_to_fp32.py`) into the directory, beside the tags: no part of a tag, so a copy the
    disk refuses is let go."""
    held = _Held()
    files = engine.checkpoint_engine
    engine.checkpoint_engine = _HeldEngine(files, held)
    copy = getattr(engine, "_copy_recovery_script", None)  # DeepSpeed's, not public
    if copy is not None:
        engine._copy_recovery_script = lambda save_path: _Held().run(save_path, copy,
                                                                     save_path)
    try:
        yield held
    finally:
        engine.checkpoint_engine = files
        if copy is not None:
            del engine._copy_recovery_script  # the class's method again


def save(engine, directory: str, step: int) -> Saved:
    """Collective: every rank writes its part of tag step<N>; rank 0 then marks it complete,
    or, when a write failed on any rank, removes what was written of it (see the module)."""
    held = _Held()
    client_state = {"step": step, "data_position": step, "rng": _rng_state()}
    if hasattr(engine, "checkpoint_engine"):  # DeepSpeed's, with collectives inside
        with _writes_held(engine) as held:
            engine.save_checkpoint(directory, tag=tag(step), client_state=client_state,
                                   save_latest=False)  # resume reads COMPLETE, not `latest`
    else:  # workers.interleaved: one file per rank, no collective inside
        held.run(os.path.join(directory, tag(step)), engine.save_checkpoint, directory,
                 tag=tag(step), client_state=client_state)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, held.error)
    failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e) or None
    path = os.path.join(directory, tag(step))
    if dist.get_rank() == 0:
        if failed is None:
            try:
                _mark_complete(path, step)
            except OSError as exc:
                failed = f"rank 0: writing {path}/{MARKER}: {type(exc).__name__}: {exc}"
        if failed is not None:  # a partial tag: its space back, and never resumed from
            shutil.rmtree(path, ignore_errors=True)
    outcome = [failed]
    dist.broadcast_object_list(outcome, src=0)
    return Saved(None, outcome[0]) if outcome[0] else Saved(path, None)


def _mark_complete(path: str, step: int) -> None:
    """Write the marker whole or not at all: an empty one must not make a tag complete."""
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
    os.replace(tmp, os.path.join(path, MARKER))


def load(engine, directory: str, step: int) -> int:
    """Collective: restore the engine (weights, optimizer, ZeRO shards) and RNG; returns the
    number of completed steps."""
    path, client = engine.load_checkpoint(directory, tag=tag(step))
    if path is None:
        raise RuntimeError(f"checkpoint {directory}/{tag(step)} could not be loaded")
    _set_rng_state(client["rng"])
    return int(client["data_position"])
