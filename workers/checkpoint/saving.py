"""DeepSpeed checkpoints of a job: save every `checkpoint.every_steps`, resume from the newest
complete one; before any rank resumes, rank 0 makes the folder the job's own (`claim_folder`,
`service.files.checkpoint_dirs`): a folder another job wrote is neither resumed from nor written
into.

Layout: `<dir>/step<N>/` is one DeepSpeed tag (model and ZeRO shards of every rank, written by
the engine) plus a `COMPLETE` marker that rank 0 writes (atomically: a temporary file renamed)
once every rank has finished writing, each rank's step reports not acknowledged yet among
what it wrote (`trident-steps/`, `service.files.tag_steps`). A tag without the marker (a rank died
mid-save) is ignored on resume. The data position is the consumed samples (the global samples
read so far, `workers.trainer.data`), stored with the step and the RNG states in DeepSpeed's
client state and returned by `load`: a run resumed with another global batch, or during a
batch ramp, reads on from the next unread sample.

The marker records every file of the tag with its size and SHA-256 (each rank hashes what it
wrote, rank 0 the rest: `_Held`, `_mark_complete`), and a tag is resumed from only when its
files still match (`agreed_resume`, the ranks checking a share each): a damaged one is passed
over for the one before and its marker renamed, so that it is partial from then on. A marker
of before checksums (the step alone) is taken as it is.

A save the disk refuses (full, a quota, an I/O error) costs that tag only: each rank's writes
are made with their errors held (`_writes_held`), so a rank whose write failed still goes
through the save's collectives with its peers; then the ranks share their errors, and when any
failed rank 0 removes the partial tag instead of marking it. Every rank gets the reason back,
the newest complete tag stays the one to resume from, and training goes on: the next save is
tried at its step.

Retention (`checkpoint.keep_last`, `keep_every`): once a tag is complete, and only then, rank 0
deletes the older tags the policy does not keep (`prune`), each marker first so that a tag
half deleted is never taken for complete, and the partial tags older than it (what a crash in a
save left). A crash during a save therefore never deletes the newest complete tag: nothing is
deleted before its successor is marked. The new tag's size and the steps deleted go with the
step's report (`StepReport.checkpoint_bytes`, `checkpoints_removed`), and the controller keeps
the job's tags and their bytes (`service.store.checkpoints`).

Called by `workers.trainer.train`; `agreed_resume_step` and `newest_complete_step` also by custom
entrypoints. One module because saving, marking, pruning and resuming are one protocol over the
same tag and its marker: each step of it relies on what the others write.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from service.contract.reports import StepReport
from service.contract.spec import JobSpec
from service.files.checkpoint_dirs import CheckpointRefused, CheckpointWriter, claim, retained
from service.files.checkpoint_tags import (
    DAMAGED,
    MARKER,
    TAG,
    complete_steps,
    file_digest,
    marker_text,
    mismatch,
    recorded,
    tag,
    tag_files,
)
from service.files.checkpoint_tags import (
    newest_complete_step as newest_complete_step,  # for custom entrypoints
)
from service.files.tag_steps import STEPS_DIR
from workers.checkpoint import relayout
from workers.checkpoint.tag_forms import FULL, LAYOUT, UNIVERSAL, layout_record, tree_bytes


class Position(NamedTuple):
    """Where a loaded tag leaves the run."""

    step: int
    """Optimizer steps done."""
    samples: int | None
    """Global samples consumed (None: a tag written without them)."""


class Resume(NamedTuple):
    """The tag every rank resumes from, and the newer ones skipped as damaged."""

    step: int
    """0: none, the job starts fresh."""
    skipped: list[str]
    """`step <N>: why` of each newer complete tag whose files no longer match its marker."""


def agreed_resume_step(directory: str | None) -> int:
    """`agreed_resume`'s step (custom entrypoints)."""
    return agreed_resume(directory).step


def agreed_resume(directory: str | None) -> Resume:
    """Collective: the newest complete tag whose files match their sizes and SHA-256 as its
    marker records them (a tag of before checksums is taken as it is), the same on every
    rank. Rank 0 names each candidate and its files; every rank checks a share of them (the
    hashing spread over the ranks, `CHUNK` bytes at a time); a tag any rank finds damaged is
    skipped for the one before, and rank 0 renames its marker (`DAMAGED`), so that it is a
    partial tag from then on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    skipped: list[str] = []
    below: int | None = None
    while True:
        pick: list[Any] = [_candidate(directory, below) if rank == 0 else None]
        dist.broadcast_object_list(pick, src=0)
        step, files, unreadable = pick[0]
        if step == 0 or (files is None and unreadable is None):
            return Resume(step, skipped)
        assert directory is not None
        path = os.path.join(directory, tag(step))
        bad = unreadable or next((m for rel, n, d in (files or [])[rank::world]
                                  if (m := mismatch(path, rel, n, d))), None)
        found: list[str | None] = [None] * world
        dist.all_gather_object(found, bad)
        why = next((b for b in found if b), None)
        if why is None:
            return Resume(step, skipped)
        skipped.append(f"step {step}: {why}")
        if rank == 0:
            with contextlib.suppress(OSError):  # unrenamed, it is still passed over below
                os.replace(os.path.join(path, MARKER), os.path.join(path, DAMAGED))
        below = step


def _candidate(directory: str | None,
               below: int | None) -> tuple[int, list[tuple[str, int, str]] | None, str | None]:
    """Rank 0: the newest complete tag below `below` (0: none), its recorded files (None: a
    marker of before checksums), or why its marker cannot be read."""
    steps = [s for s in complete_steps(directory) if below is None or s < below] \
        if directory else []
    if not steps:
        return 0, None, None
    try:
        files = recorded(os.path.join(directory or "", tag(steps[-1])))
    except ValueError as exc:
        return steps[-1], None, str(exc)
    return steps[-1], None if files is None else [(r, n, d) for r, (n, d) in files.items()], None


def claim_folder(directory: str | None, writer: CheckpointWriter | None) -> None:
    """Collective: rank 0 makes `directory` `writer`'s job's
    (`service.files.checkpoint_dirs.claim`);
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
    bytes: int | None = None
    """The complete tag's size on disk as rank 0 sees it (None: not saved)."""
    removed: tuple[int, ...] = ()
    """The steps of the older tags deleted after it by the retention policy."""

    def report_fields(self, step: int | None = None) -> dict[str, Any]:
        """A step report's fields of this save (`step`: the tag's, when not the report's
        own step)."""
        return {"checkpoint": self.path, "checkpoint_error": self.error,
                "checkpoint_bytes": self.bytes, "checkpoint_step": step,
                "checkpoints_removed": list(self.removed) or None}


class _Held:
    """The first error of a rank's checkpoint writes, held instead of raised; and the size and
    SHA-256 of each file it wrote through the engine, hashed by the rank that wrote it (while
    it is in the page cache) for the tag's marker."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.digests: dict[str, tuple[int, str]] = {}

    def digest(self, path: str) -> None:
        self.digests[os.path.abspath(path)] = file_digest(path)

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
        self._held.run(path, self._held.digest, path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._held.run(path, self._engine.makedirs, path, exist_ok=exist_ok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@contextmanager
def _writes_held(engine: Any,
                 wrap: Callable[[Any, _Held], Any] = _HeldEngine) -> Iterator[_Held]:
    """DeepSpeed's engine with every write of `save_checkpoint` held: its shards go through
    `checkpoint_engine`, so that the collectives between them (its barriers, the tag check)
    still run on every rank. Global rank 0 also copies DeepSpeed's recovery scripts
    (`zero_to_fp32.py`) into the directory, beside the tags: no part of a tag, so a copy the
    disk refuses is let go."""
    held = _Held()
    files = engine.checkpoint_engine
    engine.checkpoint_engine = wrap(files, held)
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


def save(engine, directory: str, step: int, spec: JobSpec | None = None,
         consumed_samples: int | None = None,
         steps: Callable[[str], None] | None = None) -> Saved:
    """Collective: every rank writes its part of tag step<N>; rank 0 then records the layout
    that wrote it (`LAYOUT`), marks it complete and prunes the older tags by `spec`'s
    retention policy (`prune`), or, when a write failed on any rank, removes what was
    written of it (see the module). `consumed_samples`: the global samples read so far
    (`workers.trainer.data`), kept with it. `steps`: writes this rank's unacknowledged step reports
    into the tag (given its path; `service.files.tag_steps`), before it is marked complete."""
    held = begin(engine, directory, step, consumed_samples, steps)
    return finish(directory, step, spec, held)


def begin(engine, directory: str, step: int, consumed_samples: int | None,
          steps: Callable[[str], None] | None,
          wrap: Callable[[Any, _Held], Any] = _HeldEngine) -> _Held:
    """Collective (DeepSpeed's own barriers): `save`'s writes of tag step<N> on this rank,
    through `wrap`'s checkpoint engine; their errors and digests held."""
    held = _Held()
    client_state = {"step": step, "data_position": step, "rng": _rng_state(),
                    "consumed_samples": consumed_samples,
                    # what DeepSpeed's universal conversion asks of the client (no TP split)
                    "universal_checkpoint_info": {}}
    if hasattr(engine, "checkpoint_engine"):  # DeepSpeed's, with collectives inside
        with _writes_held(engine, wrap) as held:
            engine.save_checkpoint(directory, tag=tag(step), client_state=client_state,
                                   save_latest=False)  # resume reads COMPLETE, not `latest`
    else:  # workers.trainer.interleaved: one file per rank, no collective inside
        held.run(os.path.join(directory, tag(step)), engine.save_checkpoint, directory,
                 tag=tag(step), client_state=client_state)
    path = os.path.join(directory, tag(step))
    if steps is not None:  # shared with the shards' errors below: marked only once written
        held.run(os.path.join(path, STEPS_DIR), steps, path)
    return held


def finish(directory: str, step: int, spec: JobSpec | None, held: _Held) -> Saved:
    """Collective, once this rank's writes of tag step<N> are done (`held`): the ranks share
    their errors and digests; rank 0 marks the tag complete and prunes, or removes it."""
    policy = spec.checkpoint if spec is not None else None
    path = os.path.join(directory, tag(step))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (held.error, held.digests))
    failed = "; ".join(f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e) or None
    if dist.get_rank() == 0:
        if failed is None:
            try:
                if spec is not None:
                    _write_layout(path, spec)
                _mark_complete(path, step, {p: d for _, hashed in gathered
                                            for p, d in hashed.items()})
            except OSError as exc:
                failed = f"rank 0: writing {path}/{MARKER}: {type(exc).__name__}: {exc}"
        if failed is not None:  # a partial tag: its space back, and never resumed from
            shutil.rmtree(path, ignore_errors=True)
    size = 0
    removed: tuple[int, ...] = ()
    if dist.get_rank() == 0 and failed is None:
        size = tree_bytes(path)
        removed = tuple(prune(directory, step, keep_last=policy.keep_last if policy else None,
                              keep_every=policy.keep_every if policy else None))
    outcome = [(failed, size, removed)]
    dist.broadcast_object_list(outcome, src=0)
    failed, size, removed = outcome[0]
    return Saved(None, failed) if failed else Saved(path, None, size, removed)


def saved_now(engine, directory: str, last: StepReport, spec: JobSpec,
              consumed_samples: int | None,
              steps: Callable[[str], None] | None = None) -> StepReport:
    """Collective, when the job is preempted (`RankContext.save_now`): save the tag of the
    steps done (`last`'s step) as `save` does; `last` again with the tag, its own step's
    (the controller stores the step once, and records the tag; an earlier tag marked with
    `last`'s first report is replaced)."""
    saved = save(engine, directory, last.step, spec, consumed_samples, steps)
    return last.model_copy(update=saved.report_fields())


def prune(directory: str, newest: int, *, keep_last: int | None,
          keep_every: int | None) -> list[int]:
    """Rank 0, once tag `newest` is complete: delete the complete tags older than it that the
    policy does not keep (`service.files.checkpoint_dirs.retained`) and the partial ones older than
    it; the complete tags' steps deleted. Nothing newer than `newest` is touched, nor anything at
    all without `keep_last`. A tag's marker goes first: a deletion cut short leaves a partial
    tag, never resumed from, deleted by the next prune."""
    if keep_last is None:
        return []
    complete: list[int] = []
    partial: list[int] = []
    for name in os.listdir(directory):
        m = TAG.match(name)
        if m is None or int(m.group(1)) >= newest:
            continue
        done = os.path.exists(os.path.join(directory, name, MARKER))
        (complete if done else partial).append(int(m.group(1)))
    keep = retained([*complete, newest], keep_last=keep_last, keep_every=keep_every)
    removed = []
    for s in sorted(complete):
        if s in keep:
            continue
        try:
            os.remove(os.path.join(directory, tag(s), MARKER))
        except OSError:
            continue  # not deletable: it stays complete, and is tried again next time
        shutil.rmtree(os.path.join(directory, tag(s)), ignore_errors=True)
        shutil.rmtree(os.path.join(directory, tag(s) + UNIVERSAL), ignore_errors=True)
        shutil.rmtree(os.path.join(directory, tag(s) + FULL), ignore_errors=True)
        removed.append(s)
    for s in partial:
        shutil.rmtree(os.path.join(directory, tag(s)), ignore_errors=True)
    return removed


def _mark_complete(path: str, step: int, hashed: dict[str, tuple[int, str]]) -> None:
    """Write the marker whole or not at all (an empty one must not make a tag complete), with
    every file of the tag and its size and SHA-256: those the ranks `hashed` as they wrote
    them, the others (the layout, the step reports, a layout's own files) hashed here."""
    digests = {rel: hashed.get(os.path.abspath(os.path.join(path, rel)))
               or file_digest(os.path.join(path, rel)) for rel in tag_files(path)}
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(marker_text(step, digests))
    os.replace(tmp, os.path.join(path, MARKER))


def _write_layout(path: str, spec: JobSpec) -> None:
    tmp = os.path.join(path, LAYOUT + ".tmp")
    with open(tmp, "w") as f:
        json.dump(layout_record(spec), f)
    os.replace(tmp, os.path.join(path, LAYOUT))


def load(engine, directory: str, step: int, spec: JobSpec | None = None,
         groups: Any = None) -> Position:
    """Collective: restore the engine (weights, optimizer, ZeRO shards) and RNG; returns the
    completed steps and the samples they consumed. A tag another layout wrote (`written_by`)
    is loaded from a form converted once (the layout-free form by every rank, each its share)
    and kept beside it (`workers.checkpoint.relayout`)."""
    name = tag(step)
    if spec is not None:
        how = relayout.how(directory, step, spec)
        if how == "layout-free":
            client = relayout.load_layout_free(engine, directory, step, spec, groups)
            if client.get("rng") is not None:
                _set_rng_state(client["rng"])  # rank 0's of the old layout
            return _position(client)
        if how == "universal":
            name = relayout.universal_tag(directory, step)
            engine._config.load_universal_checkpoint = True  # DeepSpeed's own switch
    path, client = engine.load_checkpoint(directory, tag=name)
    if path is None:
        raise RuntimeError(f"checkpoint {directory}/{tag(step)} could not be loaded")
    _set_rng_state(client["rng"])
    return _position(client)


def _position(client: dict[str, Any]) -> Position:
    samples = client.get("consumed_samples")
    return Position(int(client["data_position"]), None if samples is None else int(samples))
