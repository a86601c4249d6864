"""What a job's checkpoint tags hold that the store may lack, stored: the tags themselves in
the job's checkpoint index, and the step reports each carries (`service.files.tag_steps`).

Rank 0 reports each tag it completed, and the tags retention deleted, with a step's report
(`service.control.worker_reports`); every rank's reports wait in its buffer until the controller
stored them. An attempt that ends before they are polled (a node lost, a partition, a
preemption cut short, the controller killed) takes them along, while its tags already hold
those steps. `recover` makes the store whole again from the job's folder:

- the index: a complete tag on disk that it does not list is added (its attempt as the tag's
  reports name it, its bytes counted on disk), and a tag it lists that is gone from the disk
  is marked removed;
- the steps: from the newest complete tag down, each tag's reports are stored under the
  attempt that ran them, until a tag whose step every rank's report of is stored already
  (the store keeps each rank's reports in the order it sent them, a tag's in one
  transaction: every older step is stored then too) or a tag that carries none of the job's.
  The store keeps one report per (job, attempt, step, rank): what was polled already, or is
  read again, is stored once.

The controller calls it for each active job in its first pass, after re-attaching the live
groups (a controller that starts indexes what its predecessor never heard of), after each
job's group is stopped, and before each attempt starts, so that no attempt resumes from a tag
whose steps are not stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pydantic import ValidationError

from service.contract.reports import StepReport
from service.files.checkpoint_tags import complete_steps, tag, tree_bytes
from service.files.tag_steps import Carried, read
from service.store import Job, Store
from service.store.checkpoints import CheckpointIndex
from service.store.metrics import MetricsIngest

log = logging.getLogger(__name__)


@dataclass
class Recovered:
    """What `recover` stored."""

    indexed: list[int] = field(default_factory=list)
    """Tags added to the index."""
    gone: list[int] = field(default_factory=list)
    """Tags the index listed, marked removed (not on disk)."""
    steps: dict[int, list[int]] = field(default_factory=dict)
    """Per tag read, the steps its reports hold."""
    skipped: list[str] = field(default_factory=list)
    """Files passed over, and why."""


def recover(store: Store, ingest: MetricsIngest, *, job: Job, folder: str,
            max_bytes: int) -> Recovered:
    """Index the complete tags of `folder` (job `job`'s) and store the step reports they
    carry that the store lacks (see the module); an event says what was stored. Each file of
    reports is read up to `max_bytes`."""
    out = Recovered()
    try:
        on_disk = complete_steps(folder)
    except OSError as exc:  # unreadable now: nothing is judged gone
        log.warning("job %s: checkpoint folder %s not listed: %s", job.id, folder, exc)
        return out
    carried: dict[int, list[Carried]] = {}
    for step in reversed(on_disk):
        files, skipped = read(f"{folder}/{tag(step)}", job_id=job.id, max_bytes=max_bytes)
        out.skipped += skipped
        # A tag saved again by a later attempt (of another world size: files it did not
        # overwrite) is that attempt's.
        files = [f for f in files if f.attempt == max(g.attempt for g in files)]
        carried[step] = files
        if not files or _stored(ingest, job.id, step, files):
            break
        out.steps[step] = _store(ingest, job.id, files)
    _index(store, job, folder, on_disk, carried, max_bytes, out)
    _tell(store, job, out)
    return out


def _stored(ingest: MetricsIngest, job_id: int, step: int, files: list[Carried]) -> bool:
    """Whether every rank's report of tag `step`'s own step is stored."""
    return ingest.whole(job_id=job_id, attempt=files[0].attempt, step=step)


def _store(ingest: MetricsIngest, job_id: int, files: list[Carried]) -> list[int]:
    """Store the valid step reports of one tag's files, in one transaction; their steps."""
    rows = []
    for f in files:
        for raw in f.reports:
            try:
                report = StepReport.model_validate(raw)
            except ValidationError:
                continue  # a rank wrote what it would have sent: never invalid but by hand
            if report.rank == f.rank:
                rows.append(report.row())
    ingest.record(job_id=job_id, attempt=files[0].attempt, world_size=files[0].world_size,
                  rows=rows)
    return sorted({r["step"] for r in rows})


def _index(store: Store, job: Job, folder: str, on_disk: list[int],
           carried: dict[int, list[Carried]], max_bytes: int, out: Recovered) -> None:
    index = CheckpointIndex(store)
    listed = {c.step for c in index.list(job_id=job.id)}
    out.gone = sorted(listed - set(on_disk))
    if out.gone:
        index.gone(job_id=job.id, steps=out.gone)
    layout = job.plan.layout.model_dump(mode="json")
    for step in on_disk:
        if step in listed:
            continue
        files = carried.get(step)
        if files is None:
            files, _ = read(f"{folder}/{tag(step)}", job_id=job.id, max_bytes=max_bytes)
        # The attempt that wrote it, as its reports say; else (no reports: a tag copied from
        # another job, or saved by an entrypoint) the job's newest.
        attempt = files[0].attempt if files else max(job.attempts, 1)
        index.saved(job_id=job.id, attempt=attempt, step=step,
                    size=tree_bytes(f"{folder}/{tag(step)}"), layout=layout)
        out.indexed.append(step)


def _tell(store: Store, job: Job, out: Recovered) -> None:
    parts = []
    if out.steps:
        parts.append("stored the step reports that tag(s) " + ", ".join(
            f"{tag(t)} (steps {min(s)}-{max(s)})" if s else tag(t)
            for t, s in sorted(out.steps.items())) + " carry: a report stored before is"
            " kept once")
    if out.indexed:
        parts.append(f"indexed tag(s) found on disk: {', '.join(map(tag, out.indexed))}")
    if out.gone:
        parts.append(f"tag(s) no longer on disk marked removed: {', '.join(map(tag, out.gone))}")
    for why in out.skipped:
        log.warning("job %s: step reports passed over: %s", job.id, why)
    if out.skipped and parts:  # said with what was stored: a tag read again says it once
        parts.append(f"passed over: {'; '.join(out.skipped[:5])}")
    if parts:
        store.add_event(job_id=job.id, kind="recovered",
                        message="checkpoint folder read: " + "; ".join(parts),
                        data={"indexed": out.indexed, "gone": out.gone,
                              "steps": {str(t): [min(s), max(s)] if s else []
                                        for t, s in out.steps.items()},
                              "skipped": out.skipped[:5]})
