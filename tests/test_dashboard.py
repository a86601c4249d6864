"""The dashboard's server side: vendored files match their manifest, downsampling keeps every
bucket's extremes, the jobs list filters, sorts and pages in SQL, chart series and the ranks
grid follow the store, and the pages render (or refuse bad parameters naming them)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from api.app import create_app
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.settings import Settings
from service.store import Store
from service.store.charts import job_series
from service.store.dashboard import jobs_page, queue
from service.store.heartbeats import HeartbeatLog
from service.submission.intake import submit
from service.views.rank_status import rank_status
from tests.conftest import authed_client, migrated_sqlite, record_steps, tiny_spec

VENDOR = Path(__file__).resolve().parent.parent / "api" / "static" / "vendor"


def test_vendored_files_match_the_manifest() -> None:
    manifest = json.loads((VENDOR / "manifest.json").read_text())
    listed = set()
    for pkg in manifest["packages"]:
        assert pkg["package"] and pkg["version"] and pkg["license"]
        for rel, digest in pkg["files"].items():
            listed.add(rel)
            assert hashlib.sha256((VENDOR / rel).read_bytes()).hexdigest() == digest, rel
    on_disk = {str(p.relative_to(VENDOR)) for p in VENDOR.rglob("*")
               if p.is_file() and p.name != "manifest.json"}
    assert on_disk == listed  # nothing vendored without a manifest entry


def row(step: int, rank: int = 0, **over: Any) -> dict[str, Any]:
    r = {"step": step, "rank": rank, "loss": 10.0 - step / 10, "step_time_s": 0.5,
         "tokens_per_s": 100.0, "data": {}}
    r.update(over)
    return r


def started(store: Store, **spec: Any) -> int:
    job = submit(store, JobSpec.model_validate(tiny_spec(**spec)))
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=job.id, to=to, message=to.value)
    store.start_attempt(job_id=job.id)
    return job.id


def test_jobs_page_filters_sorts_and_pages(store: Store) -> None:
    spec = JobSpec.model_validate(tiny_spec())
    ids = [submit(store, spec.model_copy(update={"name": f"exp-{i % 3}_x"})).id
           for i in range(7)]
    store.transition(job_id=ids[0], to=JobState.CANCELLED, message="x")
    run = started(store)
    record_steps(store, job_id=run, attempt=1, rows=[row(1), row(2), row(2, rank=1)])
    items, total = jobs_page(store, limit=3)
    assert total == 8 and [i.job.id for i in items] == [run, ids[6], ids[5]]
    assert items[0].latest is not None and items[0].latest.step == 2
    assert items[0].progress == pytest.approx(2 / 6)
    items, total = jobs_page(store, name="exp-1", sort="id", desc=False)
    assert total == 2 and [i.job.id for i in items] == [ids[1], ids[4]]
    assert jobs_page(store, name="%")[1] == 0 and jobs_page(store, name="_x")[1] == 7
    items, total = jobs_page(store, states=[JobState.QUEUED], limit=2, offset=2)
    assert total == 6 and [i.job.id for i in items] == [ids[4], ids[3]]
    assert [i.queue_position for i in items] == [4, 3]
    assert "3 job(s) before it" in (items[0].queue_reason or "")
    assert [i.job.id for i in queue(store)[0]] == ids[1:] and queue(store)[1] == 6
    assert [i.job.id for i in queue(store, limit=2)[0]] == ids[1:3]
    assert jobs_page(store, owner="nobody")[1] == 0


def test_series_take_the_newest_attempt_of_each_step_and_downsample(store: Store) -> None:
    job_id = started(store)
    record_steps(store, job_id=job_id, attempt=1, rows=[row(s) for s in range(1, 6)])
    store.start_attempt(job_id=job_id)  # resumed from step 3: steps 4, 5 redone
    record_steps(store, job_id=job_id, attempt=2, rows=[
        row(s, loss=1.0, step_time_s=0.25) for s in range(4, 8)])
    job = store.get_job(job_id=job_id)
    out = job_series(store, job)
    assert out["rows"] == 7 and out["step"] == list(range(1, 8))
    assert out["loss"] == [9.9, 9.8, 9.7, 1.0, 1.0, 1.0, 1.0]
    assert out["predicted"]["step_time_s"] == job.plan.time.step_s
    mfu = job.plan.mfu
    assert mfu is not None
    assert out["mfu"][0] == pytest.approx(mfu * 100.0 / job.plan.tokens_per_s)


def test_long_series_are_bucketed_keeping_every_spike_and_dip(store: Store) -> None:
    job_id = started(store)
    rows = [row(s, step_time_s=0.5 + (s % 7) / 100) for s in range(1, 5001)]
    rows[1233]["step_time_s"] = 9.0  # step 1234: a spike
    rows[4320]["tokens_per_s"] = 1.0  # step 4321: a dip
    rows[2000]["loss"] = None  # not finite on step 2001
    record_steps(store, job_id=job_id, attempt=1, rows=rows[:3000])
    store.start_attempt(job_id=job_id)  # resumed from step 2500: 2501.. redone
    record_steps(store, job_id=job_id, attempt=2, rows=[
        {**r, "loss": -1.0} for r in rows[2500:]])
    out = job_series(store, store.get_job(job_id=job_id), max_points=600)
    assert out["rows"] == 5000
    assert 500 <= len(out["step"]) <= 600
    assert out["step"][0] == 1 and out["step"][-1] == 5000 and out["step"] == sorted(out["step"])
    assert max(out["step_time_s"]) == 9.0 and min(out["tokens_per_s"]) == 1.0
    assert min(out["step_time_s"]) == 0.5
    # Attempt 2's values replace attempt 1's from step 2501: only its losses appear there.
    late = [loss for step, loss in zip(out["step"], out["loss"], strict=True) if step > 2501]
    assert late and set(late) == {-1.0}
    early = [loss for step, loss in zip(out["step"], out["loss"], strict=True) if step <= 2500]
    assert min(x for x in early if x is not None) == 10.0 - 2500 / 10  # attempt 1's last


def test_ranks_grid_compares_memory_and_compute_per_stage(store: Store) -> None:
    job_id = started(store, parallel={"tp": 1, "pp": 2, "dp": 2, "zero": 1})
    job = store.get_job(job_id=job_id)

    def rep(rank: int, compute: float, peak: int) -> dict[str, Any]:
        return row(1, rank, step_time_s=compute + 0.1, data={
            "memory": {"process_peak_bytes": peak}, "timed": True,
            "comm": {"dp": {"all_reduce": {"time_s": 0.1, "bytes": 1.0, "calls": 1.0}}}})

    record_steps(store, job_id=job_id, attempt=1, rows=[
        rep(0, 1.0, 100), rep(1, 1.0, 100), rep(2, 1.0, 200), rep(3, 3.0, 200)])
    store.set_placement(job_id=job_id, number=1, placement={"ranks": [
        {"rank": r, "hostname": f"n{r}", "gpu_ids": [str(r)]} for r in range(4)]})
    store.add_event(job_id=job_id, attempt=1, kind="straggler", message="slow",
                    data={"rank": 3})
    grid = rank_status(store, job).to_json()
    cells = {c["rank"]: c for c in grid["cells"]}
    assert len(cells) == job.world_size == 4
    stage = job.plan.stage_of()
    by_stage = {m.stage: m.total for m in job.plan.memory_by_stage}
    for r, c in cells.items():
        assert c["pp"] == stage[r] and c["node"] == f"n{r}" and c["gpu"] == str(r)
        assert c["memory_ratio"] == pytest.approx(c["memory_peak_bytes"] / by_stage[stage[r]])
    # Ranks 2 and 3 share a stage: 3 computes 3 s against their median of 2 s.
    assert stage[2] == stage[3]
    assert cells[3]["compute_ratio"] == pytest.approx(1.5)
    assert cells[2]["compute_ratio"] == pytest.approx(0.5)
    assert cells[3]["straggler"] and not cells[2]["straggler"]
    assert all(c["heartbeat_age_s"] is None for c in cells.values())  # none seen yet
    seen = time.time() - 30.0
    HeartbeatLog(store).record(job_id=job_id, attempt=1, seen={1: seen})
    before = time.time()
    cells = {c["rank"]: c for c in rank_status(store, job).to_json()["cells"]}
    assert before - seen <= cells[1]["heartbeat_age_s"] <= time.time() - seen
    assert cells[0]["heartbeat_age_s"] is None


@pytest.fixture
def client(tmp_path: Path) -> Any:
    store = Store(migrated_sqlite(tmp_path / "d.db"))
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as c:
        yield c, store


def test_pages_render_and_refuse_bad_parameters(client: Any) -> None:
    c, store = client
    job_id = started(store)
    record_steps(store, job_id=job_id, attempt=1, rows=[row(1), row(2)])
    queued = submit(store, JobSpec.model_validate(tiny_spec(name="waiting"))).id
    page = c.get("/", params={"state": "RUNNING"})
    assert page.status_code == 200 and f'data-job="{job_id}"' in page.text
    assert f'data-job="{queued}"' not in page.text
    rows = c.get("/ui/jobs/rows", params={"name": "waiting"}).text
    assert f'data-job="{queued}"' in rows and "first in line" in rows
    for url in (f"/jobs/{job_id}", "/plan", f"/plan?job={job_id}", "/cluster", "/queue"):
        r = c.get(url)
        assert r.status_code == 200 and "<!doctype html>" in r.text, url
    job_page = c.get(f"/jobs/{job_id}").text
    assert "<td>not measured</td>" in job_page  # no model states sent
    # The memory view: each category planned against measured, per stage, with the gap.
    assert "Memory by stage: planned against measured" in job_page
    assert '<table class="grid memory-gap" data-stage="0">' in job_page
    for cat in ("params", "grads", "optimizer", "activations", "gathered", "buckets",
                "framework", "total"):
        assert f'<tr data-category="{cat}">' in job_page, cat
    assert "waiting" in c.get("/queue").text
    for params, field in [({"sort": "nope"}, "sort"), ({"per_page": 1000}, "per_page"),
                          ({"page": 0}, "page"), ({"name": "x" * 129}, "name"),
                          ({"state": "DONE"}, "state")]:
        r = c.get("/", params=params)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][:2] == ["query", field]
    assert c.get("/jobs/999").status_code == 404
    assert c.get("/plan?job=999").status_code == 404
    assert c.get(f"/api/v1/jobs/{job_id}/series", params={"max_points": 5}).status_code == 422
    assert c.get(f"/jobs/{job_id}/logs/rank-5.log").status_code == 404


def test_the_cluster_page_shows_each_nodes_state_and_events(client: Any) -> None:
    c, store = client
    store.upsert_nodes(nodes=[{"node_id": "a" * 56, "hostname": "gpu-1"},
                              {"node_id": "b" * 56, "hostname": "gpu-2"},
                              {"node_id": "c" * 56, "hostname": "gpu-3"}])
    store.cordon_node(node_id="a" * 56, by="admin", reason="fan <noise>")
    store.cordon_node(node_id="b" * 56, by="admin", reason="BIOS", drain_grace_s=60)
    text = c.get("/cluster").text
    cells = re.findall(r'<td class="node-state (\w+)">([^<]*)</td>', text)
    assert [(state, cell.split(" ago: ")[0].split(" by ")[0]) for state, cell in cells] == [
        ("cordoned", "cordoned"), ("draining", "draining"), ("ready", "ready")]
    assert cells[0][1].endswith("ago: fan &lt;noise&gt;")  # escaped
    assert cells[1][1].startswith("draining by admin") and "BIOS (deadline " in cells[1][1]
    assert text.count("<summary>events (1)</summary>") == 2


def test_the_cluster_page_shows_a_slow_link(client: Any) -> None:
    c, store = client
    store.upsert_nodes(nodes=[{"node_id": "a" * 56, "hostname": "h1"},
                              {"node_id": "b" * 56, "hostname": "h2"}])
    store.mark_slow_link(node_id="b" * 56, slow=True, by="job 3",
                         message="slow link: host 10.0.0.12 <measured> 1 MB/s")
    text = c.get("/cluster").text
    cells = re.findall(r'<td class="node-link (\w+)">([^<]*)</td>', text)
    assert [state for state, _ in cells] == ["ok", "slow"]
    assert cells[1][1].startswith("slow link: host 10.0.0.12 &lt;measured&gt; 1 MB/s (job 3, ")
    store.mark_slow_link(node_id="b" * 56, slow=False, by="job 3", message="healthy")
    cells = re.findall(r'<td class="node-link (\w+)">', c.get("/cluster").text)
    assert cells == ["ok", "ok"]


def test_hangs_group_identical_stacks(client: Any) -> None:
    c, store = client
    job_id = started(store)
    store.add_event(job_id=job_id, attempt=1, kind="hang", message="rank 1 never arrived",
                    data={"never_arrived": [1], "waiting": []})
    for rank, text in [(0, "A"), (1, "B"), (2, "A")]:
        store.add_event(job_id=job_id, attempt=1, kind="stacks", message="stacks",
                        data={"rank": rank, "stacks": text})
    items = c.get(f"/api/v1/jobs/{job_id}/hangs").json()["items"]
    assert len(items) == 1 and items[0]["summary"] == "rank 1 never arrived"
    assert items[0]["stacks"] == [{"ranks": [0, 2], "text": "A"}, {"ranks": [1], "text": "B"}]


def test_pages_load_nothing_from_the_network() -> None:
    """Every script, stylesheet and image the templates name is served by the API itself."""
    templates = Path(__file__).resolve().parent.parent / "api" / "templates"
    for path in templates.glob("*.html"):
        text = path.read_text()
        for ref in re.findall(r'(?:src|href)="([^"]+)"', text):
            assert not re.match(r"^(?:https?:)?//", ref), (path.name, ref)
        for ref in re.findall(r'<script src="([^"]+)"', text):
            assert (templates.parent / ref.removeprefix("/")).is_file(), (path.name, ref)


def test_comm_steps_split_each_step_into_compute_and_dimensions(client: Any) -> None:
    c, store = client
    job_id = started(store)

    def rep(step: int, rank: int, dp: float, timed: bool = True) -> dict[str, Any]:
        return row(step, rank, step_time_s=1.0, data={"timed": timed, "comm": {
            "dp": {"all_reduce": {"time_s": dp, "bytes": 1.0, "calls": 1.0}},
            "tp": {"all_reduce": {"time_s": 0.1, "bytes": 1.0, "calls": 1.0}}}})

    record_steps(store, job_id=job_id, attempt=1, rows=[
        rep(1, 0, 0.2), rep(1, 1, 0.4), rep(2, 0, 0.3, timed=False), rep(2, 1, 0.3, False),
        rep(3, 0, 0.5), rep(3, 1, 0.5)])
    out = c.get(f"/api/v1/jobs/{job_id}/comm/steps").json()
    job = store.get_job(job_id=job_id)
    assert out["predicted"]["step"] == job.plan.time.step_s
    assert [s["step"] for s in out["steps"]] == [1, 3]  # untimed steps carry no times
    first = out["steps"][0]
    assert first["ranks"] == 2 and first["dp"] == pytest.approx(0.3)
    assert first["tp"] == pytest.approx(0.1) and first["pp"] == 0
    assert first["compute"] == pytest.approx(1.0 - 0.4)
    assert first["bubble"] is None  # the ranks did not measure it
    assert c.get(f"/api/v1/jobs/{job_id}/comm/steps", params={"last": 201}).status_code == 422


def test_jobs_api_lists_steps_restarts_and_reasons_in_a_fixed_number_of_queries(
        client: Any) -> None:
    """`GET /api/v1/jobs` carries each job's newest step, loss, measured step time, restarts
    and reason; it filters by name, sorts, and costs the same queries for 2 jobs as for 12."""
    from sqlalchemy import event

    c, store = client
    run = started(store, name="big-run")
    record_steps(store, job_id=run, attempt=1, rows=[row(1), row(2, step_time_s=0.25)])
    failed = submit(store, JobSpec.model_validate(tiny_spec(name="broken"))).id
    store.transition(job_id=failed, to=JobState.FAILED, message="x",
                     error="Traceback (most recent call last):\n  x\nValueError: bad lr")
    queued = submit(store, JobSpec.model_validate(tiny_spec(name="later"))).id
    items = {j["id"]: j for j in c.get("/api/v1/jobs").json()["items"]}
    assert (items[run]["step"], items[run]["total_steps"], items[run]["loss"],
            items[run]["step_time_s"], items[run]["restarts"], items[run]["reason"]) == (
        2, 6, pytest.approx(9.8), 0.25, 0, None)
    assert items[failed]["reason"] == "ValueError: bad lr" and items[failed]["step"] is None
    assert items[queued]["queue_position"] == 1
    assert items[queued]["reason"].startswith("first in line")
    assert [j["id"] for j in c.get("/api/v1/jobs", params={"name": "big"}).json()["items"]] \
        == [run]
    by_name = c.get("/api/v1/jobs", params={"sort": "name", "desc": False}).json()["items"]
    assert [j["name"] for j in by_name] == ["big-run", "broken", "later"]
    assert c.get("/api/v1/jobs", params={"sort": "colour"}).status_code == 422
    detail = c.get(f"/api/v1/jobs/{run}").json()
    assert detail["step"] == 2 and detail["predicted_vs_measured"]["step_s"]["measured"]

    def queries(page: dict[str, Any]) -> int:
        seen: list[str] = []

        def listen(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
            seen.append(statement)

        event.listen(store.engine, "before_cursor_execute", listen)
        try:
            assert c.get("/api/v1/jobs", params=page).status_code == 200
        finally:
            event.remove(store.engine, "before_cursor_execute", listen)
        return len([q for q in seen if "jobs" in q or "metrics" in q])

    few = queries({"limit": 2})
    for i in range(10):
        record_steps(store, job_id=started(store), attempt=1, rows=[row(1), row(i + 2)])
    assert queries({"limit": 12}) == few


def test_comm_steps_take_the_measured_bubble_out_of_pp(client: Any) -> None:
    c, store = client
    job_id = started(store, parallel={"tp": 1, "pp": 2, "dp": 1, "zero": 0})

    def rep(step: int, rank: int, pp: float, bubble: float) -> dict[str, Any]:
        return row(step, rank, step_time_s=1.0, data={
            "timed": True, "bubble_s": bubble,
            "comm": {"pp": {"send": {"time_s": pp, "bytes": 1.0, "calls": 1.0}}}})

    # Step 2: rank 1's timer saw none of its waits as PP time; what the bubble exceeds of PP
    # comes out of compute, so the bars still add up to the step.
    record_steps(store, job_id=job_id, attempt=1, rows=[
        rep(1, 0, 0.5, 0.3), rep(1, 1, 0.5, 0.3), rep(2, 0, 0.5, 0.3), rep(2, 1, 0.0, 0.3)])
    first, second = c.get(f"/api/v1/jobs/{job_id}/comm/steps").json()["steps"]
    assert first["bubble"] == pytest.approx(0.3) and first["pp"] == pytest.approx(0.2)
    assert first["compute"] == pytest.approx(0.5)
    assert second["bubble"] == pytest.approx(0.3) and second["pp"] == 0
    assert second["compute"] == pytest.approx(0.7)
    for step in (first, second):
        assert sum(step[k] for k in ("compute", "tp", "pp", "dp", "bubble")) == \
            pytest.approx(1.0)


def test_queue_positions_follow_priority_then_age_for_one_job_and_for_a_page(
        client: Any) -> None:
    """Admission order is priority, then age: a page's positions (one numbering of the
    queue) and one job's (a count of the jobs ahead) agree, and a running job has none."""
    c, store = client
    ids = [submit(store, JobSpec.model_validate(tiny_spec(name=n, priority=p))).id
           for n, p in [("a", 0), ("b", 5), ("c", 0), ("d", 5)]]
    running = started(store, name="runs")
    want = dict(zip(ids, [3, 1, 4, 2], strict=True))
    page = {j["id"]: j["queue_position"] for j in c.get("/api/v1/jobs").json()["items"]}
    assert page == {**want, running: None}
    assert {j: c.get(f"/api/v1/jobs/{j}").json()["queue_position"] for j in ids} == want
    r = c.post("/api/v1/jobs", json=tiny_spec(name="e", priority=1))
    assert r.status_code == 201 and r.json()["queue_position"] == 3  # after b and d


def test_a_place_in_the_queue_is_counted_from_the_index_alone(sqlite_store: Store) -> None:
    """A queued job's place is a count of the queued jobs ahead of it (a submission's
    answer, a queued job's detail): SQLite counts them in `ix_jobs_queue` (state, priority,
    id) without reading their rows, as the count of jobs by state does. With only the state
    indexed, each queued job's row was read for its priority: with 5,000 queued, 1.1 ms more
    CPU per submission (`python -m bench.profile_api --queued 5000`)."""
    from service.store.dashboard import _AHEAD, _BY_STATE

    submit(sqlite_store, JobSpec.model_validate(tiny_spec()))
    with sqlite_store.engine.connect() as c:
        def plan(stmt: Any, params: dict[str, Any]) -> list[str]:
            compiled = stmt.compile(dialect=c.dialect)
            bound = compiled.construct_params(params)
            return [r[3] for r in c.exec_driver_sql(
                "EXPLAIN QUERY PLAN " + str(compiled),
                tuple(bound[k] for k in compiled.positiontup or ()))]

        assert plan(_AHEAD, {"job_id": 1}) == [
            "SEARCH jobs USING INTEGER PRIMARY KEY (rowid=?)",
            "SEARCH jobs USING COVERING INDEX ix_jobs_queue (state=?)"]
        assert plan(_BY_STATE, {}) == ["SCAN jobs USING COVERING INDEX ix_jobs_queue"]


def test_series_carry_the_recipe_and_the_job_page_its_deepspeed_config(client: Any) -> None:
    import html

    from service.contract.ds_config import deepspeed_config
    from service.store.metrics import MetricsIngest

    c, store = client
    job_id = started(store)
    ingest = MetricsIngest(store)  # as the controller stores what the ranks report
    ingest.record(job_id=job_id, attempt=1, world_size=2, rows=[
        row(s, rank=r, lr=1e-3 * s, grad_norm=2.0 + s) for s in (1, 2, 3) for r in (0, 1)])
    store.start_attempt(job_id=job_id)  # step 3 again, under another rate
    ingest.record(job_id=job_id, attempt=2, world_size=2, rows=[
        row(3, rank=r, lr=5e-4, grad_norm=None) for r in (0, 1)])
    series = c.get(f"/api/v1/jobs/{job_id}/series").json()
    assert series["recipe_step"] == [1, 2, 3]
    assert series["lr"] == [pytest.approx(1e-3), pytest.approx(2e-3), pytest.approx(5e-4)]
    assert series["grad_norm"] == [pytest.approx(3.0), pytest.approx(4.0), None]
    page = c.get(f"/jobs/{job_id}").text
    shown = re.search(r'<pre class="scroll" id="ds-config">(.*?)</pre>', page, re.S)
    assert shown is not None
    spec = store.get_job(job_id=job_id).spec
    assert json.loads(html.unescape(shown.group(1))) == deepspeed_config(spec)


def test_a_jobs_detail_follows_each_new_step_and_attempt(client: Any) -> None:
    """`GET /jobs/{id}` reads the job, its line, rank 0's newest row and its secrets' names
    in one snapshot (`job_page`) and works out the comparison with the plan again only when
    that newest row changed: each new step, and a new attempt, shows in the next answer."""
    from service.store.metrics import MetricsIngest

    c, store = client
    job_id = started(store)
    ingest = MetricsIngest(store)
    first = c.get(f"/api/v1/jobs/{job_id}").json()
    assert first["step"] is None and first["predicted_vs_measured"]["steps_measured"] == 0
    assert first["secrets"] == [] and first["reason"] is None
    ingest.record(job_id=job_id, attempt=1, world_size=2, rows=[
        row(s, rank=r, step_time_s=0.5) for s in range(1, 6) for r in (0, 1)])
    got = c.get(f"/api/v1/jobs/{job_id}").json()
    assert got["step"] == 5 and got["predicted_vs_measured"]["step_s"]["measured"] == 0.5
    ingest.record(job_id=job_id, attempt=1, world_size=2, rows=[
        row(s, rank=r, step_time_s=2.0) for s in range(6, 16) for r in (0, 1)])
    got = c.get(f"/api/v1/jobs/{job_id}").json()
    assert got["step"] == 15 and got["predicted_vs_measured"]["step_s"]["measured"] == 2.0
    store.start_attempt(job_id=job_id)  # a restart: only the newest attempt is compared
    ingest.record(job_id=job_id, attempt=2, world_size=2, rows=[
        row(s, rank=r, step_time_s=1.0) for s in (15, 16) for r in (0, 1)])
    got = c.get(f"/api/v1/jobs/{job_id}").json()
    assert got["predicted_vs_measured"]["step_s"]["measured"] == 1.0
    assert got["predicted_vs_measured"]["steps_measured"] == 2
    (stage,) = got["predicted_vs_measured"]["memory_by_stage"]
    assert stage["stage"] == 0 and stage["ranks"] == [0, 1] and stage["step"] == 16
    assert [c["name"] for c in stage["categories"]][0] == "params"
    assert c.get("/api/v1/jobs/999999").status_code == 404
