"""Where the goodput ledger is read, for jobs that really ran: light ranks on a local Ray (one
killed at a step, its job retried from the start), the controller stepped in this process,
the API served by uvicorn over the same store with a price per CPU-hour. `trident goodput -o
json` and `GET /api/v1/jobs/{id}/goodput` agree; `trident compare`, `GET /metrics` and
`POST /plan` read the same ledgers and prices."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from cli.main import app  # noqa: E402
from service.contract.prices import ProfilePrice  # noqa: E402
from service.contract.spec import JobSpec  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.control.controller import Controller  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.store import Store  # noqa: E402
from service.submission.intake import Submitter, submit  # noqa: E402
from tests.conftest import tiny_spec, user_token  # noqa: E402
from tests.servers import HTTP, served_stack  # noqa: E402
from tests.waiting import drive  # noqa: E402

pytestmark = pytest.mark.slow
runner = CliRunner()
CPU_HOUR = 3600.0
"""A CPU-second costs 1."""


@pytest.fixture
def served(local_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[tuple[str, Store, Controller, str]]:
    monkeypatch.setenv("TRIDENT_CONFIG_DIR", str(tmp_path / "config"))
    settings = Settings(data_dir=tmp_path, light_ranks=True, allow_faults=True,
                        prices={"cpu": ProfilePrice(cpu_hour=CPU_HOUR)})
    with served_stack(settings, step_s=None, start_timeout_s=120, cancel_grace_s=5) as stack:
        token = user_token(stack.store)
        monkeypatch.setenv("TRIDENT_TOKEN", token)
        yield stack.url, stack.store, stack.controller, token


def cli(url: str, *args: str) -> str:
    r = runner.invoke(app, [*args, "--server", url])
    assert r.exit_code == 0, r.output
    return r.output


def seconds(ledger: dict[str, Any], category: str, key: str = "seconds") -> float:
    return next(c[key] for c in ledger["categories"] if c["category"] == category)


def test_the_cli_prometheus_compare_and_plan_read_the_ledgers(
        served: tuple[str, Store, Controller, str]) -> None:
    url, store, controller, token = served
    auth = {"Authorization": f"Bearer {token}"}
    train = {"steps": 8, "global_batch": 8, "micro_batch": 2, "precision": "fp32"}
    ids = [submit(store, JobSpec.model_validate(tiny_spec(
        name=name, program="light", train=train, max_retries=1, monitor={"probe": False},
        faults=faults)), by=Submitter(owner="admin", project="default")).id
        for name, faults in (("killed", [{"kind": "kill", "rank": 1, "step": 5,
                                           "attempt": 1}]), ("clean", []))]
    for job_id in ids:
        assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                     300) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
    ledgers = {j: HTTP.get(f"{url}/api/v1/jobs/{j}/goodput", headers=auth).json()
               for j in ids}
    killed, clean = (ledgers[j] for j in ids)
    # The CLI prints the API's answer, exactly.
    for job_id in ids:
        assert json.loads(cli(url, "goodput", str(job_id), "-o", "json")) == ledgers[job_id]
    # Light ranks save no checkpoint: the first attempt's steps were all redone.
    assert killed["steps_lost"] >= 4 and killed["steps_counted"] == 8
    assert seconds(killed, "lost") > 0 and seconds(killed, "recovery") > 0
    assert clean["steps_lost"] == 0 and seconds(clean, "lost") == 0
    assert killed["ettr"] < clean["ettr"]
    for ledger in (killed, clean):
        assert sum(c["seconds"] for c in ledger["categories"]) == pytest.approx(
            ledger["wall_s"], rel=0.01)
        # Priced: a CPU-second costs 1.
        assert ledger["cost"] == pytest.approx(sum(c["cpu_seconds"]
                                                   for c in ledger["categories"]))
        assert ledger["planned_cost"] is not None and ledger["planned_cost"] > 0
    text = cli(url, "goodput", str(ids[0]))
    assert text.splitlines()[0] == (f"Job {ids[0]} (killed) of admin, project default:"
                                    " SUCCEEDED, 2 rank(s) on cpu")
    assert f"Steps:        8 counted, {killed['steps_lost']} lost" in text
    # compare: each job's ETTR is its ledger's.
    cmp = json.loads(cli(url, "compare", str(ids[0]), str(ids[1]), "-o", "json"))
    assert [r["ettr"] for r in cmp["runs"]] == [killed["ettr"], clean["ettr"]]
    # /metrics: the two ledgers summed (nothing else ran).
    fams = {f.name: f for f in text_string_to_metric_families(
        HTTP.get(f"{url}/metrics", headers=auth).text)}

    def sample(name: str, **labels: str) -> float:
        hits = [s.value for s in fams[name].samples
                if all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(hits) == 1, (name, labels)
        return float(hits[0])

    for category in ("lost", "recovery", "training"):
        assert sample("trident_job_seconds", category=category) == pytest.approx(
            seconds(killed, category) + seconds(clean, category))
        assert sample("trident_project_cpu_seconds", project="default",
                      category=category) == pytest.approx(
            seconds(killed, category, "cpu_seconds") + seconds(clean, category, "cpu_seconds"))
    # The plan's cost: what the ledger says the job would cost at its plan.
    spec = store.get_job(job_id=ids[1]).spec.model_dump(mode="json")
    plan = HTTP.post(f"{url}/api/v1/plan", json=spec, headers=auth).json()
    assert plan["cost"] == pytest.approx(clean["planned_cost"])
