"""What a worker group's poll brought, stored: its step reports (validated, through
`MetricsIngest`), its probe reports (to the attempt's health), its events, and a `checkpoint`
event for each checkpoint the ranks failed to save (`StepReport.checkpoint_error`) and each
damaged one they did not resume from (`StepReport.resume_skipped`), a `guard_skip`,
`guard_spike` or `guard_rollback` event for each step the training guard skipped, judged a
spike or rolled back after (`GUARD_EVENTS`, rank 0's report: every rank decides alike), and each
tag rank 0 completed or deleted into the job's checkpoint index (`service.store.checkpoints`).

The controller calls `store_poll` for every poll of a group it watches, and once more for the
last poll of a cancelled group, taken beside its loop while the group is stopped
(`service.control.teardown`), when that attempt's health no longer listens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from service.cluster.data_plane import PollResult
from service.contract.reports import ProbeReport, StepReport
from service.monitor.attempt import AttemptHealth
from service.store import Store
from service.store.checkpoints import CheckpointIndex
from service.store.metrics import MetricsIngest


def guard_events(report: StepReport) -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, message, data) of the guard's events in `report` (rank 0's)."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    if report.skipped:
        out.append(("guard_skip", f"step {report.step}: update skipped ({report.guard});"
                    f" {report.skipped_steps} skipped in this attempt",
                    {"step": report.step, "reason": report.guard,
                     "skipped_steps": report.skipped_steps}))
    elif report.guard:
        out.append(("guard_spike", f"step {report.step}: {report.guard}",
                    {"step": report.step, "reason": report.guard}))
    if report.rollback is not None:
        rb = report.rollback
        out.append(("guard_rollback", f"after step {report.step}: rolled back to the checkpoint"
                    f" of step {rb.to_step} ({rb.reason}); the samples"
                    f" {', '.join(f'[{a}, {b})' for a, b in rb.samples)} are not read again",
                    {"step": report.step, "to_step": rb.to_step, "samples": rb.samples,
                     "reason": rb.reason}))
    return out


def _same(text: str) -> str:
    return text


def store_poll(store: Store, ingest: MetricsIngest, *, job_id: int, attempt: int,
               world_size: int, poll: PollResult, health: AttemptHealth | None,
               redact: Callable[[str], str] = _same) -> int:
    """Store `poll`'s reports and events; the number of step reports stored. An invalid
    report is dropped with a warning event; `health` (None: nobody watches the attempt any
    more) sees every valid one. The text of what is stored from the ranks (events, errors)
    goes through `redact` (the job's secrets out, `service.secrets.redact`)."""
    rows: list[dict[str, Any]] = []
    failed_saves: list[StepReport] = []
    damaged: list[StepReport] = []
    saves: list[StepReport] = []
    guarded: list[StepReport] = []
    for raw in poll.reports:
        try:
            if raw.get("kind") == "probe":
                if health is not None:
                    health.probe_report(ProbeReport.model_validate(raw))
                continue
            report = StepReport.model_validate(raw)
            rows.append(report.row())
            if report.checkpoint_error and report.rank == 0:  # every rank says the same
                failed_saves.append(report)
            if report.resume_skipped and report.rank == 0:
                damaged.append(report)
            if (report.guard or report.rollback) and report.rank == 0:
                guarded.append(report)
            if report.checkpoint and report.checkpoint_bytes is not None and report.rank == 0:
                saves.append(report)
            if health is not None:
                health.step_report(report)
        except (ValidationError, KeyError, TypeError) as exc:
            store.add_event(job_id=job_id, attempt=attempt, kind="warning",
                            message=redact(f"dropped an invalid worker report: {exc}"),
                            data={"report": {k: redact(str(v)[:200]) for k, v in raw.items()}})
    for ev in poll.events:
        data = ev.get("data") or {}
        store.add_event(job_id=job_id, attempt=attempt, kind=str(ev.get("kind", "info"))[:32],
                        message=redact(str(ev.get("message", ""))[:10000]),
                        data=data if redact is _same else {k: redact(v) if isinstance(v, str)
                                                           else v for k, v in data.items()})
    ingest.record(job_id=job_id, attempt=attempt, world_size=world_size, rows=rows)
    # After the rows: a poll whose rows failed to store comes again, and its events with it.
    for report in failed_saves:
        store.add_event(job_id=job_id, attempt=attempt, kind="checkpoint",
                        message=f"the checkpoint of step {report.checkpoint_step or report.step}"
                        " was not saved; training"
                        " goes on, and a restart resumes from the newest complete checkpoint:"
                        f" {redact(report.checkpoint_error or '')}",
                        data={"step": report.checkpoint_step or report.step,
                              "error": redact(report.checkpoint_error or "")})
    for report in guarded:
        for kind, message, data in guard_events(report):
            store.add_event(job_id=job_id, attempt=attempt, kind=kind, message=redact(message),
                            data=data)
    for report in damaged:
        for why in report.resume_skipped or []:
            store.add_event(job_id=job_id, attempt=attempt, kind="checkpoint",
                            message=f"not resumed from the checkpoint of {redact(why)}; its"
                            f" files no longer match the checksums recorded when it was saved:"
                            f" resumed from step {report.resumed_from} instead (0: from the"
                            " start), and that tag is no longer complete",
                            data={"damaged": redact(why), "resumed_from": report.resumed_from})
    if saves:
        index = CheckpointIndex(store)
        layout = store.get_job(job_id=job_id).plan.layout.model_dump(mode="json")
        for report in saves:
            assert report.checkpoint_bytes is not None
            index.saved(job_id=job_id, attempt=attempt,
                        step=report.checkpoint_step or report.step,
                        size=report.checkpoint_bytes, layout=layout,
                        removed=report.checkpoints_removed)
    return len(rows)
