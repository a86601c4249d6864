"""The dashboard in a real browser (Playwright driving Debian's chromium) against a running
stack: the API on a port, the controller stepping in a thread, a local Ray, real jobs of
light ranks (`program: light`, `workers.rank.light`: the steps of a job, a chatty custom
entrypoint, one that raises, one that fails its first attempt). One stack for every test of
the module. Each test saves a screenshot of its page under var/screenshots/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("playwright")

from playwright.sync_api import Page, expect  # noqa: E402

from service.contract.prices import ProfilePrice  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.store import Store  # noqa: E402
from tests.conftest import tiny_spec, user_token  # noqa: E402
from tests.servers import HTTP, served_stack  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "var" / "screenshots"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
HTTP_TIMEOUT_S = 60
"""For the test's own requests: generous, so that a loaded machine is slow, not a failure."""


# Waits for the page are generous too: the tests check what the page shows, not how fast.
expect.set_options(timeout=30_000)


AUTH: dict[str, str] = {}
"""The admin's Authorization header, once the stack is up (the REST calls of the tests)."""


def get(url: str, **kw: Any) -> httpx.Response:
    return HTTP.get(url, timeout=HTTP_TIMEOUT_S, headers=AUTH, **kw)


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    """Debian's chromium (`make install` installs it): Playwright cannot download one here."""
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: `make install` installs it (apt-get)")
    return {**browser_type_launch_args, "executable_path": CHROMIUM}


@dataclass
class Live:
    url: str
    store: Store
    jobs: dict[str, int]
    token: str
    go: Path
    """The flaky job's first attempt fails once this file exists."""

    def job(self, name: str) -> dict[str, Any]:
        return get(f"{self.url}/api/v1/jobs/{self.jobs[name]}").json()

    def wait(self, name: str, states: set[str], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (job := self.job(name))["state"] not in states:
            assert time.monotonic() < deadline, f"{name}: {job['state']} after {timeout} s"
            time.sleep(0.3)
        return job


@pytest.fixture(scope="module")
def live(local_ray: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    # CPU-hours priced: the pages show the ledgers' costs
    settings = Settings(data_dir=tmp_path_factory.mktemp("browser"), light_ranks=True,
                        prices={"cpu": ProfilePrice(cpu_hour=0.25)})
    with served_stack(settings, start_timeout_s=600, cancel_grace_s=5) as served:
        url, store = served.url, served.store
        token = user_token(store)
        AUTH["Authorization"] = f"Bearer {token}"
        jobs = {}
        go = settings.data_dir / "flaky-go"
        # tiny's rate is small, as real ones are: its chart's ticks are 5e-5 apart
        small_lr = {"steps": 6, "global_batch": 8, "micro_batch": 2, "precision": "fp32",
                    "lr": 3e-4, "warmup_steps": 3}
        for name, spec in [("tiny", tiny_spec(name="browser-tiny", train=small_lr)),
                           ("chatty", tiny_spec(name="browser-chatty",
                                                entrypoint="tests.entrypoints:chatty")),
                           ("explode", tiny_spec(name="browser-explode",
                                                 entrypoint="tests.entrypoints:explode")),
                           ("flaky", tiny_spec(name="browser-flaky", max_retries=1,
                                               entrypoint="tests.entrypoints:flaky",
                                               env={"TRIDENT_TEST_GO": str(go)},
                                               # it waits for its test without a heartbeat
                                               monitor={"hang_timeout_s": 3600}))]:
            spec["program"] = "light"
            r = HTTP.post(f"{url}/api/v1/jobs", json=spec, timeout=HTTP_TIMEOUT_S,
                          headers=AUTH)
            assert r.status_code == 201, r.text
            jobs[name] = r.json()["id"]
        yield Live(url, store, jobs, token, go)


@pytest.fixture
def page(page: Page, live: Live, request: pytest.FixtureRequest) -> Iterator[Page]:
    """The browser page, logged in through the log-in form (the session cookie, and the CSRF
    token the pages send with what they change), failing the test on any console error; a
    screenshot at the end."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(f"{live.url}/jobs/{live.jobs['tiny']}")
    assert page.url.startswith(f"{live.url}/login"), page.url  # no session: the log-in page
    page.fill("input[name=token]", live.token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{live.url}/")
    yield page
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{request.node.name}.png"), full_page=True)
    assert not errors, errors


def test_job_page_charts_hold_every_point_and_ranks_grid_has_every_rank(live: Live,
                                                                          page: Page) -> None:
    job = live.wait("tiny", TERMINAL, 600)
    assert job["state"] == "SUCCEEDED", job["error"]
    series = get(f"{live.url}/api/v1/jobs/{job['id']}/series").json()
    assert series["rows"] == 6 and len(series["step"]) == 6
    # A guard event the controller stored (docs/guards.md): a mark on the loss chart.
    live.store.add_event(job_id=job["id"], attempt=1, kind="guard_skip",
                         message="step 3: update skipped (loss not finite)",
                         data={"step": 3, "reason": "loss not finite", "skipped_steps": 1})
    page.goto(f"{live.url}/jobs/{job['id']}#metrics")
    assert series["recipe_step"] == series["step"]  # the rate and norm of every step
    expect(page.locator("#chart-loss")).to_have_attribute("data-guard-marks", "1")
    expect(page.locator("#chart-loss .guard-marks")).to_have_text("skip @ 3")
    for key in ("loss", "step_time_s", "tokens_per_s", "mfu", "lr", "grad_norm"):
        expect(page.locator(f"#chart-{key}")).to_have_attribute("data-points", "6")
        expect(page.locator(f"#chart-{key} canvas")).to_have_count(1)
    for key in ("loss", "lr", "grad_norm"):
        tick_labels_read_as_their_ticks(page, f"#chart-{key}")
    # uPlot itself holds the six steps: its legend shows the values under the cursor.
    expect(page.locator("#series-info")).to_have_text("6 steps stored, 6 points drawn per series")
    page.locator(".tabs a[data-tab=ranks]").click()
    expect(page.locator(".rank-cell[data-rank]")).to_have_count(job["world_size"])
    expect(page.locator(".rank-cell[data-rank='1']")).to_contain_text("×")
    # Communication: the predicted split and one bar per timed step the ranks reported.
    steps = get(f"{live.url}/api/v1/jobs/{job['id']}/comm/steps").json()["steps"]
    assert steps
    page.locator(".tabs a[data-tab=comm]").click()
    expect(page.locator("#comm-bars .bar")).to_have_count(1 + len(steps))


def tick_labels_read_as_their_ticks(page: Page, chart: str) -> None:
    """The y axis's labels as drawn (`yTicks` leaves them on the chart's box): each reads as
    its tick's value (to a thousandth of it), no two alike."""
    expect(page.locator(chart)).to_have_attribute("data-ticks", re.compile(r"\[\["))
    ticks = json.loads(page.locator(chart).get_attribute("data-ticks") or "[]")
    assert len(ticks) >= 2, ticks
    labels = [label for _, label in ticks]
    assert len(set(labels)) == len(labels), (chart, ticks)
    for tick, label in ticks:
        assert abs(float(label) - tick) <= 1e-3 * max(abs(tick), 1e-12), (chart, ticks)


def test_jobs_table_lists_the_jobs_and_filters(live: Live, page: Page) -> None:
    live.wait("tiny", TERMINAL, 600)
    page.goto(live.url + "/")
    for name, job_id in live.jobs.items():
        expect(page.locator(f"tr[data-job='{job_id}']")).to_contain_text(f"browser-{name}")
    page.fill("input[name=name]", "chatty")
    page.click("#filters button[type=submit]")
    expect(page.locator("tr[data-job]")).to_have_count(1)
    expect(page.locator(f"tr[data-job='{live.jobs['chatty']}']")).to_be_visible()
    page.goto(live.url + "/")
    page.select_option("select[name=state]", ["SUCCEEDED"])
    page.click("#filters button[type=submit]")
    expect(page.locator("tr[data-job]")).to_have_count(1)
    expect(page.locator(f"tr[data-job='{live.jobs['tiny']}'] td.state")).to_have_text("SUCCEEDED")


def test_log_lines_arrive_live(live: Live, page: Page) -> None:
    live.wait("chatty", {"RUNNING"}, 600)
    page.goto(f"{live.url}/jobs/{live.jobs['chatty']}#logs")
    view = page.locator("#log-view")
    expect(view).to_contain_text("chatty rank 1 step", timeout=60_000)

    def newest() -> int:
        return max(int(n) for n in re.findall(r"chatty rank 0 step (\d+)", view.inner_text()))

    first = newest()
    expect(view).to_contain_text(f"chatty rank 0 step {first + 5}", timeout=20_000)
    page.select_option("#log-rank", "1")
    expect(page.locator("#log-view .line[data-rank='0']")).to_have_count(0)
    assert page.locator("#log-view .line[data-rank='1']").count() > 0
    page.fill("#log-search", f"step {first}")
    expect(page.locator("#log-view mark").first).to_be_visible()


def test_cancel_from_the_job_page(live: Live, page: Page) -> None:
    live.wait("chatty", {"RUNNING"}, 600)
    page.goto(f"{live.url}/jobs/{live.jobs['chatty']}")
    expect(page.locator("#job-state")).to_have_text("RUNNING")
    page.click("#cancel")
    expect(page.locator("#job-state")).to_have_text("CANCELLED", timeout=30_000)
    expect(page.locator("#cancel")).to_be_disabled()
    assert live.job("chatty")["state"] == "CANCELLED"


def test_log_out_from_the_page_ends_the_session(live: Live, page: Page) -> None:
    """The log-out button posts its form's `csrf` field from the dashboard's own origin."""
    page.click("form.logout button")
    page.wait_for_url(f"{live.url}/login")
    page.goto(f"{live.url}/")
    assert page.url.startswith(f"{live.url}/login"), page.url  # the session is over


def test_what_if_numbers_change_with_tp(live: Live, page: Page) -> None:
    page.goto(f"{live.url}/plan?job={live.jobs['tiny']}")
    step, memory = page.locator("#n-step"), page.locator("#n-memory")
    expect(step).not_to_have_text("-")
    before = (step.inner_text(), memory.inner_text())
    expect(page.locator("#headline")).to_contain_text("1×1×2")
    page.fill("#f-tp", "2")
    expect(page.locator("#headline")).to_contain_text("2×1×2")
    assert (step.inner_text(), memory.inner_text()) != before
    expect(page.locator("#n-world")).to_have_text("4")
    # No probe on this stack: every step-time constant is assumed, with its source.
    efficiency = page.locator('#constants tr[data-constant="efficiency"]')
    expect(efficiency).to_contain_text("assumed")
    expect(efficiency).to_contain_text("no published runs of its own")


def test_a_custom_entrypoints_traceback_is_in_its_rank_log(live: Live, page: Page) -> None:
    job = live.wait("explode", TERMINAL, 600)
    assert job["state"] == "FAILED" and "rank 1 exploded on purpose" in job["error"], job
    logs = get(f"{live.url}/api/v1/jobs/{job['id']}/logs", params={"rank": 1}).json()
    text = logs["ranks"][0]["text"]
    assert "Traceback (most recent call last)" in text
    assert "RuntimeError: rank 1 exploded on purpose" in text
    page.goto(f"{live.url}/jobs/{job['id']}#logs")
    expect(page.locator("#log-view")).to_contain_text("rank 1 exploded on purpose")
    expect(page.locator("#log-status")).to_contain_text("ended")


def test_the_logs_tab_moves_on_to_a_newer_attempt(live: Live, page: Page) -> None:
    live.wait("flaky", {"RUNNING"}, 600)
    page.goto(f"{live.url}/jobs/{live.jobs['flaky']}#logs")
    view = page.locator("#log-view")
    expect(view).to_contain_text("flaky rank 1 attempt 1", timeout=60_000)
    expect(page.locator("#log-status")).to_have_text("following attempt 1")
    live.go.touch()  # attempt 1 fails; the job restarts
    expect(view).to_contain_text("--- attempt 2 ---", timeout=120_000)
    # Attempt 2's ranks start (actors, imports) after its header: as long as attempt 1's did.
    expect(view).to_contain_text("flaky rank 0 attempt 2", timeout=120_000)
    text = view.inner_text()
    assert text.index("flaky rank 0 attempt 1") < text.index("--- attempt 2 ---")
    job = live.wait("flaky", TERMINAL, 600)
    assert job["state"] == "SUCCEEDED" and job["attempts"] == 2, job


def test_the_comparison_page_overlays_the_jobs_and_lists_what_differs(live: Live,
                                                                      page: Page) -> None:
    tiny = live.wait("tiny", TERMINAL, 600)
    assert tiny["state"] == "SUCCEEDED", tiny["error"]
    deadline = time.monotonic() + 600
    while (live.job("chatty")["step"] or 0) < 3:  # it reports a step every 0.2 s
        assert time.monotonic() < deadline, "chatty reported no steps"
        time.sleep(0.3)
    ids = [live.jobs["tiny"], live.jobs["chatty"]]
    page.goto(live.url + "/")
    for job_id in ids:
        page.check(f"tr[data-job='{job_id}'] input.sel")
    expect(page.locator("#compare-selected")).to_have_text("Compare selected (2)")
    page.click("#compare-selected")
    page.wait_for_url(f"{live.url}/compare?jobs={ids[0]}&jobs={ids[1]}")
    expect(page.locator("#run-rows tr[data-job]")).to_have_count(2)
    # The ended job's ETTR is its ledger's.
    ettr = get(f"{live.url}/api/v1/jobs/{ids[0]}/goodput").json()["ettr"]
    cell = page.locator(f"#run-rows tr[data-job='{ids[0]}'] td.ettr")
    expect(cell).to_have_text(f"{100 * ettr:.1f}%")
    assert float(cell.get_attribute("data-value") or "nan") == ettr
    # Both loss curves on one chart: uPlot's legend holds one series per job.
    chart = page.locator("#chart-loss")
    expect(chart).to_have_attribute("data-series", "2")
    expect(chart.locator("canvas")).to_have_count(1)
    for job_id in ids:
        expect(chart.locator(".u-legend")).to_contain_text(f"job {job_id}")
    expect(page.locator("#chart-step_time_s")).to_have_attribute("data-series", "2")
    expect(page.locator("#chart-eval_loss")).to_contain_text("No job has stored eval_loss")
    # The spec fields that differ, with each job's value.
    row = page.locator("#differences tr[data-field='entrypoint']")
    expect(row).to_contain_text("tests.entrypoints:chatty")
    expect(row).to_contain_text("unset")
    expect(page.locator("#differences tr[data-field='name']")).to_contain_text("browser-tiny")
    page.check("input[name=x-axis][value=elapsed_s]")  # by wall time: the same two curves
    expect(page.locator("#chart-loss")).to_have_attribute("data-series", "2")
    expect(page.locator("#chart-loss .u-axis").first).to_be_visible()
    tick_labels_read_as_their_ticks(page, "#chart-loss")
    # On a narrower window the tables scroll in their boxes: the page does not.
    page.set_viewport_size({"width": 900, "height": 1000})
    page.reload()
    expect(page.locator("#run-rows tr[data-job]")).to_have_count(2)
    widths = page.evaluate("[document.documentElement.scrollWidth, innerWidth,"
                           " document.querySelector('#runs').scrollWidth]")
    assert widths[0] <= widths[1] < widths[2], widths  # the table is wider than the page


_CONTRAST = """el => {
  const rgb = s => s.match(/[\\d.]+/g).map(Number);
  const lum = c => { const [r, g, b] = c.slice(0, 3).map(v => { v /= 255;
      return v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  let bg = el, back = null;
  while (bg) {
    const c = rgb(getComputedStyle(bg).backgroundColor);
    if (c.length === 3 || c[3] > 0) { back = c; break; }
    bg = bg.parentElement;
  }
  const fg = lum(rgb(getComputedStyle(el).color)), b = lum(back || [255, 255, 255]);
  return (Math.max(fg, b) + 0.05) / (Math.min(fg, b) + 0.05);
}"""
"""WCAG 2's contrast ratio of an element's text against the first background behind it."""


def test_the_header_reads_and_stays_on_one_line(live: Live, page: Page) -> None:
    page.goto(live.url + "/")
    assert page.viewport_size == {"width": 1400, "height": 1000}
    who = page.locator("header .who")
    expect(who).to_have_text("admin (admin)")
    ratio = who.evaluate(_CONTRAST)
    assert ratio >= 4.5, f"the user's name: contrast {ratio:.2f}:1, WCAG AA needs 4.5:1"
    for link in page.locator("header nav a").all():
        assert link.evaluate(_CONTRAST) >= 4.5, link.inner_text()
    first = page.locator("header nav a").first.bounding_box()
    button = page.locator("form.logout button").bounding_box()
    name = who.bounding_box()
    assert first and button and name
    middle = first["y"] + first["height"] / 2
    for box in (button, name):  # on the links' line, not wrapped below them
        assert abs(box["y"] + box["height"] / 2 - middle) < 4, (box, first)
    assert button["x"] + button["width"] <= 1400


def test_the_cluster_page_shows_a_cordoned_node_and_its_events(live: Live, page: Page) -> None:
    deadline = time.monotonic() + 120
    while not (nodes := [n for n in get(f"{live.url}/api/v1/cluster").json()["nodes"]
                         if n["alive"]]):
        assert time.monotonic() < deadline, "no node recorded"
        time.sleep(0.5)
    node_id = nodes[0]["node_id"]
    r = HTTP.post(f"{live.url}/api/v1/nodes/{node_id}/cordon", json={"reason": "browser check"},
                  headers=AUTH, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    try:
        page.goto(live.url + "/cluster")
        cell = page.locator("td.node-state.cordoned")
        expect(cell).to_contain_text("cordoned by admin")
        expect(cell).to_contain_text("browser check")
        page.locator("summary", has_text="events (1)").click()
        expect(page.locator(".node-events li")).to_contain_text(
            "cordon · cordoned by admin: browser check")
    finally:
        r = HTTP.post(f"{live.url}/api/v1/nodes/{node_id}/uncordon", headers=AUTH,
                      timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200, r.text
    page.goto(live.url + "/cluster")
    expect(page.locator("td.node-state").first).to_have_text("ready")


def test_the_cluster_and_job_pages_show_a_slow_link(live: Live, page: Page) -> None:
    """What a job's probe that found a slow link leaves (`service.monitor.attempt`: the node's
    mark and the job's event; named on real hosts by `tests/test_hosts_links.py`), as the
    pages show it. After the cordon check: it adds events to the node that check reads."""
    deadline = time.monotonic() + 120
    while not (nodes := [n for n in get(f"{live.url}/api/v1/cluster").json()["nodes"]
                         if n["alive"]]):
        assert time.monotonic() < deadline, "no node recorded"
        time.sleep(0.5)
    node_id, job_id = nodes[0]["node_id"], live.jobs["tiny"]
    said = (f"slow link: host 10.0.0.12 (node {node_id[:12]}) measured 4.79 MB/s to its peers,"
            " against 2.53e+03 MB/s between the other hosts (0.0019x)")
    live.store.add_event(job_id=job_id, kind="slow_link", message=said,
                         data={"node_id": node_id})
    assert live.store.mark_slow_link(node_id=node_id, slow=True, by=f"job {job_id}",
                                     message=said)
    try:
        page.goto(live.url + "/cluster")
        expect(page.locator("td.node-link.slow")).to_contain_text(said)
        expect(page.locator("td.node-link.slow")).to_contain_text(f"(job {job_id}, ")
        page.goto(f"{live.url}/jobs/{job_id}")
        expect(page.locator("#events")).to_contain_text(f"slow_link{said}")
    finally:
        live.store.mark_slow_link(node_id=node_id, slow=False, by=f"job {job_id}",
                                  message="link healthy again")
    page.goto(live.url + "/cluster")
    expect(page.locator("td.node-link.slow")).to_have_count(0)
    expect(page.locator("td.node-link.ok").first).to_have_text("ok")


def num(text: str | None) -> float | None:
    """A number a page left in an attribute (None: it left none, or a blank)."""
    return float(text) if text else None


def shown_seconds(page: Page, table: str) -> dict[str, float | None]:
    """The seconds per category a legend shows, as it holds them (`data-seconds`)."""
    rows = page.locator(f"{table} tr[data-category]")
    return {r.get_attribute("data-category") or "": num(r.get_attribute("data-seconds"))
            for r in rows.all()}


def api_seconds(categories: list[dict[str, Any]]) -> dict[str, float]:
    return {c["category"]: c["seconds"] for c in categories}


def settled(read_page: Any, read_api: Any, timeout: float = 90) -> tuple[Any, Any]:
    """What the page shows and what the API answers, once they agree (a ledger takes in its
    job's last stored steps for a minute after it ends, and the page follows it): the pair
    last read, equal unless they never agreed within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        shown, answered = read_page(), read_api()
        if shown == answered or time.monotonic() > deadline:
            return shown, answered
        time.sleep(1)


def test_the_job_pages_ledger_shows_the_apis_seconds(live: Live, page: Page) -> None:
    """The job page's stacked bar and legend, its timeline and its figures, against
    `GET /api/v1/jobs/{id}/goodput` and `trident goodput ID -o json` run as a process (the
    seconds as the page holds them, exactly); a picture of the ledger in var/screenshots/."""
    job = live.wait("tiny", TERMINAL, 600)
    assert job["state"] == "SUCCEEDED", job["error"]
    url = f"{live.url}/api/v1/jobs/{job['id']}/goodput"
    page.goto(f"{live.url}/jobs/{job['id']}")
    box = page.locator("#goodput")
    expect(box.locator(".gp-bar span").first).to_be_visible()

    def read_page() -> dict[str, Any]:
        legend = shown_seconds(page, "#goodput .gp-legend")
        return {"legend": legend, "cli": legend,
                "bar": {s.get_attribute("data-category"): num(s.get_attribute("data-seconds"))
                        for s in box.locator(".gp-bar span").all()},
                "ettr": num(box.locator("#gp-ettr").get_attribute("data-value")),
                "steps": box.locator("#gp-steps").get_attribute("data-value"),
                "cost": num(box.locator("#gp-cost").get_attribute("data-value"))}

    def read_api() -> dict[str, Any]:
        ledger = get(url).json()
        proc = subprocess.run(  # the CLI as a user runs it
            [sys.executable, "-m", "cli.main", "goodput", str(job["id"]), "-o", "json",
             "--server", live.url], env={**os.environ, "PYTHONPATH": str(ROOT),
                                         "TRIDENT_TOKEN": live.token},
            cwd=ROOT, capture_output=True, text=True, timeout=HTTP_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr
        return {"legend": api_seconds(ledger["categories"]),
                "cli": api_seconds(json.loads(proc.stdout)["categories"]),
                "bar": {c: v for c, v in api_seconds(ledger["categories"]).items() if v > 0},
                "ettr": ledger["ettr"],
                "steps": f"{ledger['steps_counted']}/{ledger['steps_lost']}",
                "cost": ledger["cost"]}

    shown, answered = settled(read_page, read_api)
    assert shown == answered
    ledger = get(url).json()
    assert list(shown["legend"]) == [c["category"] for c in ledger["categories"]]  # all, in order
    assert shown["bar"]["training"] > 0 and shown["steps"] == "6/0"
    assert ledger["cost"] > 0 and ledger["planned_cost"] > 0  # CPU-hours are priced here
    expect(box.locator("#gp-cost")).to_contain_text("at its plan")
    expect(box.locator("#gp-training")).to_contain_text(" / ")  # measured / predicted
    # The timeline: a stretch per segment, a mark per attempt; the bar fills its box.
    expect(box.locator(".gp-timeline .gp-seg")).to_have_count(len(ledger["segments"]))
    attempts = {s["attempt"] for s in ledger["segments"] if s["attempt"] is not None}
    expect(box.locator(".gp-attempt")).to_have_count(len(attempts))
    widths = box.locator(".gp-bar").evaluate(
        "b => [b.clientWidth,"
        " [...b.children].reduce((a, s) => a + s.getBoundingClientRect().width, 0)]")
    assert widths[1] == pytest.approx(widths[0], abs=2), widths
    # The legend reads (WCAG AA): every row in one evaluation, since the page's poll may
    # render the legend again between two calls (a row read after it is detached has no style).
    contrasts = box.locator(".gp-legend tbody").evaluate(
        f"tb => [...tb.querySelectorAll('th')].map(th => [th.innerText, ({_CONTRAST})(th)])")
    assert contrasts
    for text, contrast in contrasts:
        assert contrast >= 4.5, text
    SHOTS.mkdir(parents=True, exist_ok=True)
    box.screenshot(path=str(SHOTS / "job-goodput-ledger.png"))


def test_the_job_pages_timeline_marks_each_attempt(live: Live, page: Page) -> None:
    """A job that failed its first attempt and succeeded in its second: two attempts on its
    timeline, and its legend's seconds the API's."""
    live.go.touch()  # the flaky job's first attempt fails (if it has not yet)
    job = live.wait("flaky", TERMINAL, 600)
    assert job["state"] == "SUCCEEDED" and job["attempts"] == 2, job
    url = f"{live.url}/api/v1/jobs/{job['id']}/goodput"
    page.goto(f"{live.url}/jobs/{job['id']}")
    expect(page.locator("#goodput .gp-bar span").first).to_be_visible()
    shown, answered = settled(lambda: shown_seconds(page, "#goodput .gp-legend"),
                              lambda: api_seconds(get(url).json()["categories"]))
    assert shown == answered
    marks = page.locator("#goodput .gp-attempt")
    expect(marks).to_have_count(2)
    assert [m.get_attribute("title") for m in marks.all()] == ["attempt 1", "attempt 2"]


def test_the_cluster_page_shows_the_apis_totals(live: Live, page: Page) -> None:
    """The cluster page's totals over its window against `GET /api/v1/goodput` over the same
    window (the one the page's answer names): the cluster's categories, each project and
    owner, the jobs that lost the most time, linked to their pages."""
    job = live.wait("tiny", TERMINAL, 600)
    assert job["state"] == "SUCCEEDED", job["error"]
    page.goto(f"{live.url}/cluster?window=all")
    box = page.locator("#cluster-goodput")
    expect(page.locator("#gp-window")).to_have_value("all")

    def read_page() -> dict[str, Any]:
        page.reload()
        expect(box.locator("#gp-cluster")).to_be_visible()
        rows = {t: {r.get_attribute("data-key"): tuple(
            num(r.get_attribute(f"data-{k}")) for k in ("wall", "gpu-seconds", "cpu-seconds",
                                                          "cost"))
            for r in box.locator(f"#gp-{t} tbody tr").all()} for t in ("projects", "owners")}
        return {"until": box.get_attribute("data-until"), "since": box.get_attribute("data-since"),
                "legend": shown_seconds(page, "#cluster-goodput .gp-legend"),
                "wall": num(box.locator("#gp-cluster").get_attribute("data-wall")),
                "lost": [int(r.get_attribute("data-job") or 0)
                         for r in box.locator("#gp-top-lost tbody tr").all()], **rows}

    def read_api(window: dict[str, Any]) -> dict[str, Any]:
        params = {"until": window["until"], **({"since": window["since"]}
                                               if window["since"] else {})}
        s = get(f"{live.url}/api/v1/goodput", params=params).json()
        return {"until": window["until"], "since": window["since"],
                "legend": api_seconds(s["cluster"]["categories"]),
                "wall": s["cluster"]["wall_s"], "lost": [j["job_id"] for j in s["top_lost"]],
                **{t: {g["key"]: (g["wall_s"], g["gpu_seconds"], g["cpu_seconds"], g["cost"])
                       for g in s[t]} for t in ("projects", "owners")}}

    last: dict[str, Any] = {}

    def page_then_window() -> dict[str, Any]:
        last.clear()
        last.update(read_page())
        return last

    shown, answered = settled(page_then_window, lambda: read_api(last))
    assert shown == answered
    assert shown["since"] == "" and shown["wall"] > 0 and shown["owners"]["admin"][0] > 0
    assert shown["legend"]["training"] > 0
    for job_id in shown["lost"]:  # linked to their pages
        expect(box.locator(f"#gp-top-lost tr[data-job='{job_id}'] a")).to_have_attribute(
            "href", f"/jobs/{job_id}")
    SHOTS.mkdir(parents=True, exist_ok=True)
    box.screenshot(path=str(SHOTS / "cluster-goodput.png"))
    # Another window: the page asks for it and says which it read.
    page.select_option("#gp-window", "24h")
    expect(box).to_have_attribute("data-since", re.compile(r"^\d{4}-"))
    assert "window=24h" in page.url


def test_a_queued_jobs_page_says_what_it_would_cost_at_its_plan(live: Live, page: Page) -> None:
    """Before a job runs, its page says what its plan would cost (its ledger's
    `planned_cost`) and why it waits: here its project's quota, smaller than the job."""
    r = HTTP.post(f"{live.url}/api/v1/projects", json={"name": "held", "cpus": 0.5},
                  headers=AUTH, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 201, r.text
    spec = tiny_spec(name="browser-held")
    spec["program"] = "light"
    r = HTTP.post(f"{live.url}/api/v1/jobs", params={"project": "held"}, json=spec,
                  headers=AUTH, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    try:
        deadline = time.monotonic() + 120
        while "quota" not in (ledger := get(f"{live.url}/api/v1/jobs/{job_id}/goodput")
                              .json())["queued_reasons"]:
            assert time.monotonic() < deadline, ledger
            time.sleep(0.5)
        assert ledger["state"] == "QUEUED" and ledger["planned_cost"] > 0, ledger
        page.goto(f"{live.url}/jobs/{job_id}")
        cost = page.locator("#gp-cost")
        expect(cost).to_contain_text("would cost ")
        expect(cost).to_contain_text(" at its plan")
        assert num(cost.get_attribute("data-value")) == ledger["planned_cost"]
        expect(page.locator("#gp-queued")).to_contain_text("its project's quota")
        expect(page.locator("#goodput .gp-bar span")).to_have_count(1)  # queued, all of it
        expect(page.locator("#goodput .gp-bar span")).to_have_attribute("data-category",
                                                                         "queued")
    finally:
        r = HTTP.post(f"{live.url}/api/v1/jobs/{job_id}/cancel", headers=AUTH,
                      timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 202, r.text


def test_the_cluster_page_shows_a_spent_budget(live: Live, page: Page) -> None:
    """A project's budget of none of its hours, spent from the start: the cluster page's row
    says so, with the share `GET /api/v1/goodput` gives."""
    r = HTTP.post(f"{live.url}/api/v1/projects", json={"name": "budgeted"}, headers=AUTH,
                  timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 201, r.text
    r = HTTP.put(f"{live.url}/api/v1/projects/budgeted/budget", headers=AUTH,
                 timeout=HTTP_TIMEOUT_S, json={"cpu_hours": 0})
    assert r.status_code == 200, r.text
    try:
        answered = next(b for b in get(f"{live.url}/api/v1/goodput").json()["budgets"]
                        if b["project"] == "budgeted")
        assert answered["used"] >= 1 and answered["cpu_hours"] == 0, answered
        page.goto(f"{live.url}/cluster")
        row = page.locator("#gp-budgets tr[data-project='budgeted']")
        expect(row).to_have_attribute("data-used", str(answered["used"]).removesuffix(".0"))
        expect(row).to_contain_text("spent: new jobs are refused")
        expect(row).to_contain_text("0 of 0")  # CPU-hours spent of the budget's
        expect(row.locator("meter")).to_have_attribute("value", "1")
    finally:
        r = HTTP.delete(f"{live.url}/api/v1/projects/budgeted/budget", headers=AUTH,
                        timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200, r.text


def test_the_profiles_tab_lists_each_trace_to_download(live: Live, page: Page) -> None:
    """A stored `trident profile` request of a job: its Profiles tab links each trace file,
    which downloads as stored, and names the rank that has none and why."""
    import gzip

    from service.files.profiles import ProfileFiles, profile_root
    from service.store.profile_requests import ProfileRequests

    job_id = live.jobs["tiny"]
    requests = ProfileRequests(live.store)
    req = requests.create(job_id=job_id, requested_by="admin", steps=2, ranks=[0, 1],
                          memory=False)
    data = gzip.compress(b'{"traceEvents": []}')
    name = "rank-0.pt.trace.json.gz"
    ProfileFiles(profile_root(live.go.parent)).write(job_id, req.id, name, data)
    requests.finish(request_id=req.id, result={
        "files": [{"rank": 0, "name": name, "bytes": len(data)}], "steps": {"0": [4, 5]},
        "missing": [{"rank": 1, "reason": "not profiled: light rank (no torch)"}]})
    page.goto(f"{live.url}/jobs/{job_id}#profiles")
    link = page.locator("#profiles a")
    expect(link).to_have_text(name)
    expect(page.locator("#profiles")).to_contain_text("rank 1: not profiled: light rank")
    expect(page.locator("#profiles")).to_contain_text("rank 0: 4-5")
    with page.expect_download() as download:
        link.click()
    assert Path(download.value.path()).read_bytes() == data
