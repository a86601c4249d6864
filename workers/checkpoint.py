"""DeepSpeed checkpoints of a job: save every `checkpoint.every_steps`, resume from the newest
complete one; before any rank resumes, rank 0 makes the folder the job's own (`claim_folder`,
`service.checkpoints`): a folder another job wrote is neither resumed from nor written into.

Layout: `<dir>/step<N>/` is one DeepSpeed tag (model and ZeRO shards of every rank, written by
the engine) plus a `COMPLETE` marker that rank 0 writes after a barrier, once every rank has
finished writing. A tag without the marker (a rank died mid-save) is ignored on resume. The data
position is the step itself (see `workers.data`); it is stored with the RNG states in DeepSpeed's
client state.

Called by `workers.train`; `newest_complete_step` also by custom entrypoints.
"""

from __future__ import annotations

import os
import random
import re

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


def save(engine, directory: str, step: int) -> str:
    """Collective: every rank writes its part of tag step<N>; rank 0 then marks it complete."""
    engine.save_checkpoint(directory, tag=tag(step),
                           client_state={"step": step, "data_position": step,
                                         "rng": _rng_state()})
    dist.barrier()
    path = os.path.join(directory, tag(step))
    if dist.get_rank() == 0:
        with open(os.path.join(path, MARKER), "w") as f:
            f.write(f"{step}\n")
    dist.barrier()
    return path


def load(engine, directory: str, step: int) -> int:
    """Collective: restore the engine (weights, optimizer, ZeRO shards) and RNG; returns the
    number of completed steps."""
    path, client = engine.load_checkpoint(directory, tag=tag(step))
    if path is None:
        raise RuntimeError(f"checkpoint {directory}/{tag(step)} could not be loaded")
    _set_rng_state(client["rng"])
    return int(client["data_position"])
