"""Where a job keeps its checkpoints, and whose checkpoints a folder holds.

A job writes its DeepSpeed tags (`workers.checkpoint.saving`) into one folder of its own: its
default
folder `<data_dir>/checkpoints/job-<id>`, or the `checkpoint.dir` its spec names. The folder's
record (`trident-checkpoint.json`) says which job, and whose, it belongs to; it is written when
the job first starts, and a job never resumes from, nor writes into, a folder recorded as
another job's. Callers:

- submission (`service.submission.confine`): `CheckpointPlaces.refusal` (where a named folder may
be: a
  folder of its own inside a checkpoint root, never the data directory or what Trident keeps
  there) and `CheckpointPlaces.taken` (a folder some job already recorded as its own);
- the controller (`JobFolders`), before every attempt: `CheckpointPlaces.refusal` again (roots
  and folders change after a submission), then `claim`; after a failed attempt, `refusal`
  (a folder that became another job's is not retried);
- rank 0, before any rank resumes (`workers.checkpoint.saving.claim_folder`): `claim` again.

A tag itself, its name, its `COMPLETE` marker and the checksums that marker records, is
`service.files.checkpoint_tags`.

`refusal` is the one check of whose a folder is. Starting a job from another job's checkpoint
(a `--from-checkpoint` to come) would read that job's folder, never write it: its record names
the job, so the API can ask whether the caller may read that job, while the new job writes
only into a folder of its own.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from service.contract.specfiles import FileRefused, read_regular
from service.files.checkpoint_tags import DAMAGED, MARKER, MARKER_MAX_BYTES, TAG


class OwnedJob(Protocol):
    """What a writer is made of: a job's id and owner (`service.store.views.Job` has them;
    named by shape so that this module, which the rank-controller contract imports, imports
    nothing of the store)."""

    @property
    def id(self) -> int: ...

    @property
    def owner(self) -> str: ...


RECORD = "trident-checkpoint.json"
"""The record of a checkpoint folder: the job (id and owner) it belongs to."""
RECORD_MAX_BYTES = 64 << 10
DEFAULT_FOLDER = re.compile(r"^job-\d+$")
"""Names of the default folders under `<data_dir>/checkpoints` (see `default_folder`)."""
RULE = "a job keeps its checkpoints in a folder of its own"
"""The rule every refusal names."""
DATA_DIR_FILES = "the database, the admin token, ray/, logs/"
"""What Trident keeps in its data directory, as refusals name it."""


class CheckpointRefused(ValueError):
    """A job may not resume from, or write into, a folder; the message says why."""


class ExportRefused(ValueError):
    """A tag that is not exported as a Hugging Face model (`workers.checkpoint.hf_export`), and
    why."""


@dataclass(frozen=True)
class CheckpointWriter:
    """The job a checkpoint folder belongs to, as its record holds it."""

    job_id: int
    owner: str

    @classmethod
    def of(cls, job: OwnedJob) -> CheckpointWriter:
        return cls(job_id=job.id, owner=job.owner)

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "owner": self.owner}

    @classmethod
    def from_json(cls, data: Any) -> CheckpointWriter:
        if not isinstance(data, dict) or type(data.get("job_id")) is not int \
                or not isinstance(data.get("owner"), str):
            raise ValueError("it names no job_id and owner")
        return cls(job_id=data["job_id"], owner=data["owner"])

    def __str__(self) -> str:
        return f"job {self.job_id} (owner {self.owner})"


def default_folder(root: Path, job_id: int) -> Path:
    """A job's folder when its spec names none (`root`: `Settings.checkpoint_root`)."""
    return root / f"job-{job_id}"


def read_writer(folder: str | Path) -> CheckpointWriter | None:
    """The job `folder`'s record names; None when it has none. ValueError when the record
    cannot be read."""
    path = Path(folder) / RECORD
    try:
        raw = read_regular(str(path), RECORD_MAX_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except FileRefused as exc:
        raise ValueError(f"its record {RECORD} is not one Trident wrote ({exc})") from None
    except OSError as exc:
        raise ValueError(f"its record {RECORD} cannot be read ({exc.strerror})") from None
    try:
        return CheckpointWriter.from_json(json.loads(raw))
    except RecursionError:
        raise ValueError(f"its record {RECORD} is not one Trident wrote (JSON nested too"
                         " deep)") from None
    except ValueError as exc:  # JSON's errors are ValueErrors too
        raise ValueError(f"its record {RECORD} is not one Trident wrote ({exc})") from None


def refusal(folder: str | Path, job: CheckpointWriter | None, *,
            adopt: bool = False) -> str | None:
    """Why `job` may not resume from or write into `folder`; None when it may.

    `job` None is a job not created yet (a submission): any record is another job's. A folder
    with tags and no record holds checkpoints of unknown origin (written before folders had
    records, or copied in): refused, unless `adopt` (the job's default folder, named by its
    id, whose tags can only be its own)."""
    if os.path.lexists(folder) and not os.path.isdir(folder):
        return f"{folder} is not a directory: {RULE}"
    try:
        writer = read_writer(folder)
    except ValueError as exc:
        return f"{folder}: {exc}; {RULE}"
    if writer is not None:
        if writer == job:
            return None
        return (f"{folder} holds the checkpoints of {writer}, as its {RECORD} records: {RULE},"
                " and resumes from no other job's")
    tags = _tags(folder)
    if tags and not adopt:
        return (f"{folder} holds checkpoints ({', '.join(tags[:3])}) that no job is recorded"
                f" as having written: {RULE}, and resumes from no other job's")
    return None


def claim(folder: str | Path, job: CheckpointWriter, *, adopt: bool = False) -> None:
    """Make `folder` `job`'s: create it and its record unless it has one. CheckpointRefused
    (see `refusal`) when it is another job's; OSError when it cannot be written."""
    if why := refusal(folder, job, adopt=adopt):
        raise CheckpointRefused(why)
    path = Path(folder) / RECORD
    if path.exists():
        return  # the job's own: `refusal` read it
    os.makedirs(folder, exist_ok=True)
    record = {**job.to_json(), "written_at": datetime.now(UTC).isoformat()}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:  # claimed by another meanwhile: whose is it?
        if why := refusal(folder, job, adopt=adopt):
            raise CheckpointRefused(why) from None
        return
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
        f.write("\n")


def _tags(folder: str | Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(folder) if TAG.match(n))
    except OSError:  # none, or none this process can see (writing there fails then too)
        return []


def _within(path: str, root: str) -> bool:
    """Whether `path` is `root` or below it (both real paths)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class CheckpointPlaces:
    """Where a spec's `checkpoint.dir` may be: a folder of its own inside a checkpoint root,
    never the data directory, nor anything Trident keeps there (its database, admin token,
    `ray/`, `logs/`, other jobs' default folders)."""

    roots: list[Path]
    """`Settings.checkpoint_root_dirs`."""
    data_dir: Path | None = None

    def refusal(self, raw: str, *, root_ok: bool = False) -> str | None:
        """Why `raw` may not be a job's checkpoint folder, naming the rule; None when it may.
        Paths resolve through `..` and every symlink of the part that exists. `root_ok`: a
        checkpoint root itself may be (a folder read, not written: `read_refusal`)."""
        roots = [os.path.realpath(r) for r in self.roots]
        allowed = ", ".join(roots)
        if not os.path.isabs(raw):
            return (f"{raw!r} is not an absolute path; it must lie inside the server's"
                    f" checkpoint roots: {allowed}")
        real = os.path.realpath(raw)
        if not any(_within(real, r) for r in roots):
            return (f"{raw!r} resolves to {real}, outside the server's checkpoint roots:"
                    f" {allowed}")
        if self.data_dir is not None and (why := self._data_dir_refusal(raw, real)):
            return why
        if real in roots and not root_ok:
            return (f"{raw!r} is the checkpoint root {real} itself, where every job's folder"
                    f" is: {RULE}, below it")
        return None

    def _data_dir_refusal(self, raw: str, real: str) -> str | None:
        assert self.data_dir is not None
        data = os.path.realpath(self.data_dir)
        default = os.path.join(data, "checkpoints")
        if real == default:
            return (f"{raw!r} is {default}, where every job's default folder is: {RULE},"
                    f" such as {default}/<name>")
        if _within(real, data) and not _within(real, default):
            where = "is" if real == data else f"resolves to {real}, inside"
            return (f"{raw!r} {where} the data directory {data}, which holds Trident's own"
                    f" files ({DATA_DIR_FILES}): {RULE}, such as {default}/<name>")
        if _within(real, default):
            first = Path(os.path.relpath(real, default)).parts[0]
            if DEFAULT_FOLDER.match(first):
                folder = os.path.join(default, first)
                where = "is" if real == folder else f"resolves to {real}, in {folder},"
                return (f"{raw!r} {where} the default checkpoint folder of job {first[4:]}:"
                        f" {RULE} (leave checkpoint.dir unset for the job's own default"
                        " folder)")
        return None

    def read_refusal(self, raw: str) -> str | None:
        """Why a job may not read the folder `raw` (`init.from_hf`, the folder of
        `model.hf_config`): where its checkpoint folder could not be either (outside the
        roots, the data directory or what Trident keeps there, a folder recorded as a job's,
        checkpoints of unknown origin), though a root itself may be read. None when it may:
        a job reads another job's weights only through an export of a job its owner may
        read."""
        return self.refusal(raw, root_ok=True) or self.taken(raw)

    def taken(self, raw: str) -> str | None:
        """Why a new job may not have `raw` (inside the roots): it, or a folder that holds
        it below its root, is recorded as a job's; or it holds checkpoints of unknown
        origin. None when it is free."""
        real = os.path.realpath(raw)
        if why := refusal(real, None):
            return why
        root = max((r for r in map(os.path.realpath, self.roots) if _within(real, r)),
                   key=len, default=real)
        for parent in Path(real).parents:
            if not _within(str(parent), root) or str(parent) == root:
                break
            try:
                writer = read_writer(parent)
            except ValueError:
                writer = None  # not a job's folder as far as anyone can tell
            if writer is not None:
                return (f"{raw!r} resolves to {real}, inside {parent}, the checkpoint folder"
                        f" of {writer}: {RULE}")
        return None


@dataclass(frozen=True)
class JobFolders:
    """The controller's side: each job's checkpoint folder, made the job's before an attempt
    starts, and asked after one failed whether it is still the job's."""

    root: Path
    """Where the jobs whose spec names no `checkpoint.dir` keep theirs (`default_folder`)."""
    places: CheckpointPlaces | None = None
    """Where a named `checkpoint.dir` may be (None: not checked, only whose it is)."""

    def folder(self, job_id: int, named: str | None) -> str:
        return named or str(default_folder(self.root, job_id))

    def claim(self, job: CheckpointWriter, named: str | None) -> str:
        """The folder of `job`'s next attempt, made its own (the default folder's tags are
        adopted: named by the job's id, they are its own). CheckpointRefused when the folder
        is not the job's; OSError when it cannot be written."""
        folder = self.folder(job.job_id, named)
        if named is not None and self.places is not None and (why := self.places.refusal(named)):
            raise CheckpointRefused(f"checkpoint.dir: {why}")
        claim(folder, job, adopt=named is None)
        return folder

    def refusal(self, job: CheckpointWriter, named: str | None) -> str | None:
        """`refusal` of the job's folder (None: it is still the job's)."""
        return refusal(self.folder(job.job_id, named), job, adopt=named is None)


def retained(steps: list[int] | set[int], *, keep_last: int | None,
             keep_every: int | None) -> set[int]:
    """The complete tags' steps a retention policy keeps (`CheckpointSpec.keep_last`,
    `keep_every`): every one without `keep_last`; else the newest `keep_last`, and each whose
    step is a multiple of `keep_every`. The newest tag is always kept."""
    ordered = sorted(set(steps))
    if keep_last is None:
        return set(ordered)
    keep = set(ordered[-keep_last:])
    if keep_every:
        keep.update(s for s in ordered if s % keep_every == 0)
    return keep


@dataclass(frozen=True)
class Seeded:
    """What `seed` put into a job's folder."""

    step: int
    files: int
    bytes: int
    linked: bool
    """Hard links (no bytes copied); False: copied (another filesystem)."""
    seconds: float


def seed(folder: str | Path, source_folder: str | Path, source: CheckpointWriter, step: int,
         *, adopt: bool = False) -> Seeded | None:
    """Put tag `step` of `source`'s folder into `folder` (the job's own, claimed), for a job
    started from another job's checkpoint (`CheckpointSpec.resume_from`): its files hard
    linked (copied across filesystems) into a temporary tag, renamed, then marked complete,
    so that a seeding cut short is never resumed from. The source folder is only read. None
    when `folder` has a complete tag already (a later attempt resumes from its own).
    CheckpointRefused when the source folder is not `source`'s (`adopt`: its default folder,
    whose record may be missing) or has no complete tag `step`."""
    import shutil
    import time

    started = time.monotonic()
    if any((Path(folder) / t / MARKER).exists() for t in _tags(folder)):
        return None
    try:
        owner = read_writer(source_folder)
    except ValueError as exc:
        raise CheckpointRefused(f"checkpoint.resume_from: {source_folder}: {exc}") from None
    if (owner is None and not adopt) or (owner is not None and owner.job_id != source.job_id):
        raise CheckpointRefused(f"checkpoint.resume_from: {source_folder} is not the"
                                f" checkpoint folder of {source}")
    tag = Path(source_folder) / f"step{step}"
    if not (tag / MARKER).exists():
        raise CheckpointRefused(f"checkpoint.resume_from: {source} has no complete checkpoint"
                                f" of step {step} (in {source_folder})")
    target = Path(folder) / f"step{step}"
    tmp = Path(folder) / f".seeding-step{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)  # a partial tag of an earlier try
    files = size = 0
    linked = True
    for src in sorted(tag.rglob("*")):
        dst = tmp / src.relative_to(tag)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
            continue
        if src.relative_to(tag).as_posix() in (MARKER, DAMAGED):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:  # another filesystem, or links refused
            shutil.copy2(src, dst)
            linked = False
        files += 1
        size += src.stat().st_size
    tmp.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, target)
    marker = target / (MARKER + ".tmp")  # the source's, checksums and all: the same files
    marker.write_bytes(read_regular(str(tag / MARKER), MARKER_MAX_BYTES))
    os.replace(marker, target / MARKER)
    return Seeded(step=step, files=files, bytes=size, linked=linked,
                  seconds=time.monotonic() - started)
