"""Checkpoint retention (`checkpoint.keep_last`, `keep_every`): the policy, the pruning rank 0
does once a tag is complete, a save that fails deleting nothing, and each job's tags and bytes
on disk as the controller stores them and `GET /api/v1/jobs/{id}/checkpoints` and
`trident checkpoints` show them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from api.app import create_app
from cli.main import app
from service.cluster.data_plane import PollResult
from service.contract.spec import CheckpointSpec, JobSpec
from service.control.worker_reports import store_poll
from service.files.checkpoint_dirs import retained
from service.settings import Settings
from service.store import Store
from service.store.checkpoints import CheckpointIndex
from service.store.metrics import MetricsIngest
from service.submission.intake import Submitter, submit
from tests.conftest import tiny_spec
from tests.servers import serving
from tests.workers_spawn import run_ranks
from workers.checkpoint.saving import MARKER, prune, tag

runner = CliRunner()


def test_the_policy_keeps_the_newest_tags_and_the_multiples() -> None:
    steps = list(range(1, 11))
    assert retained(steps, keep_last=None, keep_every=None) == set(steps)
    assert retained(steps, keep_last=2, keep_every=None) == {9, 10}
    assert retained(steps, keep_last=2, keep_every=4) == {4, 8, 9, 10}
    assert retained(steps, keep_last=1, keep_every=3) == {3, 6, 9, 10}
    assert retained([5], keep_last=1, keep_every=None) == {5}
    assert retained([], keep_last=3, keep_every=2) == set()


def test_the_spec_bounds_and_names_the_retention_fields() -> None:
    assert CheckpointSpec(every_steps=2, keep_last=3, keep_every=10).keep_every == 10
    cases = [({"every_steps": 2, "keep_last": 0}, "keep_last"),
             ({"every_steps": 2, "keep_last": 10_001}, "keep_last"),
             ({"every_steps": 2, "keep_every": 4}, "keep_every: only with keep_last"),
             ({"every_steps": 3, "keep_last": 1, "keep_every": 4},
              "keep_every: 4 is not a multiple of every_steps (3)"),
             ({"every_steps": 0, "keep_last": 1, "keep_every": 4}, "keep_every")]
    for fields, why in cases:
        with pytest.raises(ValidationError, match=why.replace("(", r"\(").replace(")", r"\)")):
            CheckpointSpec.model_validate(fields)


def _tags(folder: Path, complete: list[int], partial: list[int]) -> None:
    for s in complete + partial:
        (folder / tag(s)).mkdir(parents=True)
        (folder / tag(s) / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    for s in complete:
        (folder / tag(s) / MARKER).write_text(f"{s}\n")


def _left(folder: Path) -> tuple[list[int], list[int]]:
    """(complete, partial) steps under `folder`."""
    done, part = [], []
    for p in folder.iterdir():
        if p.name.startswith("step"):
            (done if (p / MARKER).exists() else part).append(int(p.name[4:]))
    return sorted(done), sorted(part)


def test_prune_deletes_only_what_is_older_than_the_complete_tag(tmp_path: Path) -> None:
    # Steps 1-10 complete but 5 (a save a crash cut short); 11 is being written now.
    _tags(tmp_path, [s for s in range(1, 11) if s != 5], [5, 11])
    (tmp_path / "trident-checkpoint.json").write_text("{}")
    assert prune(str(tmp_path), 10, keep_last=2, keep_every=4) == [1, 2, 3, 6, 7]
    assert _left(tmp_path) == ([4, 8, 9, 10], [11])
    assert (tmp_path / "trident-checkpoint.json").exists()
    # Without keep_last nothing goes, partial tags included.
    _tags(tmp_path / "all", [1, 2], [3])
    assert prune(str(tmp_path / "all"), 2, keep_last=None, keep_every=None) == []
    assert _left(tmp_path / "all") == ([1, 2], [3])


@pytest.mark.slow
def test_after_ten_checkpoints_exactly_the_policys_tags_remain_and_a_failed_save_deletes_none(
        tmp_path: Path) -> None:
    """A real rank saves after each of 10 steps (keep_last 2, keep_every 4): steps 4, 8, 9
    and 10 remain, each report says the tag's bytes and what it deleted. A next attempt whose
    save of step 11 fails (its tag's path is taken by a file) deletes nothing. Synchronous
    saves (`async: false`): each step's own report carries its tag (an async save's is
    reported at a later step, tests/test_checkpoint_async.py)."""
    spec = JobSpec.model_validate(tiny_spec(
        parallel={"dp": 1, "zero": 1}, train={"steps": 10, "global_batch": 4,
                                              "micro_batch": 2, "precision": "fp32"},
        checkpoint={"every_steps": 1, "keep_last": 2, "keep_every": 4, "async": False}))
    (rows,) = run_ranks(spec, checkpoint_dir=str(tmp_path))
    assert _left(tmp_path) == ([4, 8, 9, 10], [])
    by_step = {r["step"]: r for r in rows}
    assert sorted(by_step) == list(range(1, 11))
    assert all(r["checkpoint_bytes"] > 100_000 for r in rows)
    removed = [s for r in rows for s in (r["checkpoints_removed"] or [])]
    assert sorted(removed) == [1, 2, 3, 5, 6, 7]
    assert by_step[3]["checkpoints_removed"] == [1]  # deleted only once 3 was complete
    assert by_step[10]["checkpoint_bytes"] == sum(
        f.stat().st_size for f in (tmp_path / "step10").rglob("*") if f.is_file())

    (tmp_path / "step11").write_text("not a tag")  # the next save cannot be written
    longer = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": 11})})
    (again,) = run_ranks(longer, checkpoint_dir=str(tmp_path))
    assert [(r["step"], r["resumed_from"]) for r in again] == [(11, 10)]
    assert again[0]["checkpoint"] is None and again[0]["checkpoint_error"]
    assert again[0]["checkpoints_removed"] is None
    assert _left(tmp_path)[0] == [4, 8, 9, 10]


def _report(step: int, rank: int, **kw: Any) -> dict[str, Any]:
    return {"kind": "step", "rank": rank, "step": step, "loss": 1.0, "step_time_s": 0.1,
            "tokens_per_s": 10.0, **kw}


def _saved(step: int, size: int, removed: list[int] | None = None) -> list[dict[str, Any]]:
    """Both ranks' reports of a step whose checkpoint was complete (as the ranks send them)."""
    return [_report(step, r, checkpoint=f"/c/step{step}", checkpoint_bytes=size,
                    checkpoints_removed=removed) for r in (0, 1)]


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Store]]:
    monkeypatch.setenv("TRIDENT_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TRIDENT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("TRIDENT_TOKEN", raising=False)
    settings = Settings(data_dir=tmp_path)
    with serving(create_app(settings)) as url:
        store = Store(settings.db_url)
        try:
            yield url, store
        finally:
            store.close()


def test_the_controller_records_each_tag_and_the_cli_lists_them(
        served: tuple[str, Store]) -> None:
    url, store = served
    spec = JobSpec.model_validate(tiny_spec(checkpoint={"every_steps": 2, "keep_last": 1}))
    job = submit(store, spec, by=Submitter(owner="admin", project="default"))
    store.start_attempt(job_id=job.id)
    ingest = MetricsIngest(store)

    def poll(reports: list[dict[str, Any]]) -> None:
        store_poll(store, ingest, job_id=job.id, attempt=1, world_size=2,
                   poll=PollResult(state="running", reports=reports), health=None)

    poll([_report(1, 0), _report(1, 1)] + _saved(2, 3000))
    poll(_saved(4, 5000, removed=[2]))
    poll(_saved(4, 5000, removed=[2]))  # sent again (not acknowledged): the same rows
    index = CheckpointIndex(store)
    assert [(c.step, c.bytes, c.removed_at is None) for c in index.list(
        job_id=job.id, removed=True)] == [(2, 3000, False), (4, 5000, True)]
    assert index.bytes_on_disk(job_id=job.id) == 5000
    assert index.list(job_id=job.id)[0].layout["dp"] == 2

    out = runner.invoke(app, ["checkpoints", str(job.id), "--server", url])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == f"job {job.id}: 1 tag(s), 4.9Ki on disk (keep_last 1)"
    assert lines[1].split() == ["STEP", "SIZE", "LAYOUT", "ATTEMPT", "SAVED"]
    assert lines[2].split()[:7] == ["4", "4.9Ki", "tp1", "pp1", "dp2", "zero2", "1"]
    out = runner.invoke(app, ["checkpoints", str(job.id), "--removed", "-o", "json",
                              "--server", url])
    got = json.loads(out.output)
    assert [(c["step"], c["removed_at"] is not None) for c in got["items"]] == [
        (2, True), (4, False)]
    assert got["bytes_on_disk"] == 5000 and got["keep_last"] == 1
    out = runner.invoke(app, ["describe", str(job.id), "--server", url])
    assert "Checkpoints:  1 tag(s), newest step 4, 4.9Ki on disk" in out.output, out.output
    out = runner.invoke(app, ["checkpoints", "999", "--server", url])
    assert out.exit_code != 0 and "999" in out.output
