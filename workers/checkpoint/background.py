"""Saves that do not stop training (`checkpoint.async: true`): the step loop waits only while
each rank copies its state to host memory; the files are written by a thread of each rank,
and the tag is marked complete on the training thread once every rank's files are durable.

What blocks: DeepSpeed's `save_checkpoint` runs on the training thread as for a synchronous
save (its barriers and tag check stay collectives of the training thread), but its checkpoint
engine is `_Snapshots`: each `save(state_dict, path)` clones the tensors to host memory and
queues them instead of writing them; the rank's step reports are written into the tag there
too (small). What is written in the background: one thread per rank `torch.save`s the queued
copies, `fsync`s each file and the tag's folders, and hashes each file for the marker.

The marker (`saving.finish`: the ranks' errors and digests gathered, rank 0's `COMPLETE`, then
retention) is a collective, so it never runs on the writer thread (a collective beside the
training's on the same gloo group is unsafe): the training thread agrees at each step boundary
whether every rank's writer is done (one tiny all-reduce, only while a save is pending) and
finishes the save then; the next save, a stop and the end of training wait for it first. So
one save is in flight at a time, and a rank that dies while writing leaves a tag without a
marker, never resumed from (the one before is), which the next prune deletes.

Why not DeepSpeed's or torch's own: DeepSpeed 0.19's `DecoupledCheckpointEngine` writes
through `FastCheckpointEngine` (DeepNVMe's aio) in a subprocess per rank, drops a save
silently when that process is gone, and its `commit` waits for the writes and runs a
`dist.barrier` inside `save_checkpoint`, so the step would wait for the files after all;
`torch.distributed.checkpoint.async_save` writes DCP's own format, not the DeepSpeed tag the
resume, the relayout conversions and `trident export` read. Keeping DeepSpeed's checkpoint
engine seam keeps the tag in the format a synchronous save writes (each tensor saved compact,
its own storage, where DeepSpeed's `torch.save` may keep a view's whole buffer).
"""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from service.contract.spec import JobSpec
from workers.checkpoint import saving
from workers.checkpoint.saving import Saved, _Held

DIE_WRITING = "TRIDENT_TEST_DIE_WRITING"
"""Tests only: `<rank>:<step>`: that rank's writer exits its process (status 17) once it has
written the first file of the save of that step, as a rank killed mid-write."""


def _to_host(obj: Any) -> Any:
    """A copy of `obj` that the training's next steps cannot change: every tensor cloned to
    host memory, the containers around them copied, any other object deep-copied (fp16's loss
    scaler changes its scale in place at later steps; a `torch.Size` or a named tuple keeps
    its type); one that cannot be copied is kept."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        items = [(k, _to_host(v)) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, list):
        return [_to_host(v) for v in obj]
    if type(obj) is tuple:  # not its subclasses: a torch.Size stays one (ZeRO-3's
        return tuple(_to_host(v) for v in obj)  # param_shapes, which zero_to_fp32 reads)
    try:
        return copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 - not copyable: written as it is then
        return obj


class _Snapshots:
    """DeepSpeed's checkpoint engine with `save` queueing a host copy instead of writing."""

    def __init__(self, engine: Any, held: _Held) -> None:
        self._engine = engine
        self._held = held
        self.queued: list[tuple[str, Any]] = []

    def save(self, state_dict: Any, path: str) -> None:
        self._held.run(path, lambda: self.queued.append((path, _to_host(state_dict))))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._held.run(path, self._engine.makedirs, path, exist_ok=exist_ok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(queued: list[tuple[str, Any]], held: _Held, tag_dir: str, engine: Any,
           step: int) -> None:
    """The writer thread: every queued file written, fsynced and hashed, then the tag's
    folders (and the step reports written on the training thread) fsynced."""
    die = os.environ.get(DIE_WRITING) == f"{torch.distributed.get_rank()}:{step}"
    try:
        for path, state in queued:
            held.run(path, engine.save, state, path)
            held.run(path, _fsync, path)
            held.run(path, held.digest, path)
            if die:
                os._exit(17)
        queued.clear()  # the host copies go now, not at the next save
        for root, _, files in os.walk(tag_dir):
            for name in files:
                held.run(root, _fsync, os.path.join(root, name))
            held.run(root, _fsync, root)
    except BaseException as exc:  # noqa: BLE001 - any failure costs the tag, never a silent mark
        held.error = held.error or f"writing {tag_dir}: {type(exc).__name__}: {exc}"


class Pending:
    """A save whose files this rank's thread is writing."""

    def __init__(self, directory: str, step: int, spec: JobSpec | None, held: _Held,
                 thread: threading.Thread) -> None:
        self.directory, self.step, self.spec = directory, step, spec
        self._held, self._thread = held, thread

    def written(self) -> bool:
        """This rank's files are durable (or failed); not a collective."""
        return not self._thread.is_alive()

    def finish(self) -> Saved:
        """Collective, on the training thread: wait for this rank's writer, then mark the tag
        complete and prune as a synchronous save does (`saving.finish`)."""
        self._thread.join()
        return saving.finish(self.directory, self.step, self.spec, self._held)


def begin(engine: Any, directory: str, step: int, spec: JobSpec | None,
          consumed_samples: int | None, steps: Callable[[str], None] | None) -> Pending:
    """Collective: snapshot tag step<N> into host memory (what blocks) and start this rank's
    writer thread. An engine without DeepSpeed's checkpoint engine (the interleaved one)
    writes as it does synchronously, and only the marker waits."""
    snapshots: list[_Snapshots] = []

    def wrap(files: Any, held: _Held) -> _Snapshots:
        snapshots.append(_Snapshots(files, held))
        return snapshots[-1]

    held = saving.begin(engine, directory, step, consumed_samples, steps, wrap)
    queued = snapshots[0].queued if snapshots else []
    files = snapshots[0]._engine if snapshots else None
    thread = threading.Thread(target=_write, name=f"checkpoint-step{step}", daemon=True,
                              args=(queued, held, os.path.join(directory, saving.tag(step)),
                                    files, step))
    thread.start()
    return Pending(directory, step, spec, held, thread)
