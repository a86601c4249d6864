"""Recovery drills on hosts in network namespaces: `python -m bench.chaos [--runs N]`.

Three hosts of 2 CPUs (`tests.hosts`: network namespaces on a bridge of its own, each a
`trident node start` node) and `trident up --ray-address` on the head's host. Each drill
submits a job of `STEPS` steps of the tiny GPT (one rank per host, a checkpoint every `EVERY`
steps), waits for step `FAULT_AT`, does one thing to the host of rank 1, and reads back from
the REST API what happened:

- `loss+spare`: the host powered off (every process in its namespace killed); a third host is
  free to take its place;
- `loss, elastic`: the same with a job of three ranks on the three hosts (`elastic.min_ranks`
  2), which re-plans onto the two left;
- `partition`: the host's link down until the job has moved on, then up again;
- `drain`: `POST /nodes/{host}/drain` (cordon, then a checkpoint at the next step boundary
  and a move), then uncordoned;
- `slow link`: a job over the three hosts probing every 10 s, the host of rank 2 limited to
  40 Mbit/s each way (`tc ... tbf`): the seconds until the monitor names it, whether it
  named the right one, and until it clears it once the limit is lifted.

Per run: **detect** (the fault to the end of the attempt, as stored: the controller knowing
the attempt is over), **first step** (the fault to the first step stored after it), **redone**
(steps the first attempt stored after the checkpoint the next one resumed from) and
**effective** (seconds of the job's kept steps over the job's wall time, from its start to its
end: the share of time spent training; the same job with no fault, run each round, gives the
share that start-up and checkpoints alone leave). The table goes to stdout, the runs to
`var/bench/chaos.json`, and with `--docs` the table replaces the one between the markers in
`docs/reliability.md`. Needs root; takes about a minute a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.hosts import (
    Host,
    Hosts,
    all_joined,
    attempts,
    available,
    dp_job,
    events,
    finish,
    steps,
    stored_once,
    submit,
    up_on_hosts,
)
from tests.servers import HTTP
from tests.up import Up
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
STEPS, EVERY, FAULT_AT = 60, 3, 5
BEGIN, END = "<!-- chaos:begin -->", "<!-- chaos:end -->"
RAY_DEFAULTS = {"RAY_health_check_initial_delay_ms": "5000", "RAY_health_check_period_ms": "3000",
                "RAY_health_check_timeout_ms": "10000", "RAY_health_check_failure_threshold": "5"}
"""Ray's own health-check settings (`--ray-defaults`), against which the head's are measured
(`service.cluster.rayhead.HEALTH_CHECK_ENV`)."""


def _t(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def _rank1_host(hosts: Hosts, up: Up, job_id: int) -> Host:
    ip = next(r["ip"] for r in attempts(up, job_id)[0]["placement"]["ranks"] if r["rank"] == 1)
    return next(h for h in hosts.hosts if h.address == ip)


def _power_off(hosts: Hosts, up: Up, host: Host) -> Callable[[], None]:
    hosts.kill(host)
    return lambda: hosts.start_node(host)


def _cut_off(hosts: Hosts, up: Up, host: Host) -> Callable[[], None]:
    hosts.partition(host)
    return lambda: hosts.heal(host)


def _drain(hosts: Hosts, up: Up, host: Host) -> Callable[[], None]:
    r = HTTP.post(f"{up.server}/api/v1/nodes/{host.address}/drain", headers=up.auth,
                  json={"reason": "chaos drill", "grace_s": 60}, timeout=30)
    r.raise_for_status()
    return lambda: HTTP.post(f"{up.server}/api/v1/nodes/{host.address}/uncordon",
                             headers=up.auth, timeout=30).raise_for_status()


DRILLS: dict[str, tuple[dict[str, Any], Callable[[Hosts, Up, Host], Callable[[], None]]]] = {
    "loss+spare": (dp_job("loss-spare", 2, steps=STEPS, every=EVERY), _power_off),
    "loss, elastic": (dp_job("loss-elastic", 3, steps=STEPS, every=EVERY,
                             elastic={"min_ranks": 2, "wait_s": 3}), _power_off),
    "partition": (dp_job("partition", 2, steps=STEPS, every=EVERY), _cut_off),
    "drain": (dp_job("drain", 2, steps=STEPS, every=EVERY), _drain),
}


def effective(up: Up, job_id: int, job: dict[str, Any], got: list[dict[str, Any]]) -> float:
    """Seconds of the job's kept steps (a redone step's newest run) over its wall time."""
    newest = {m["step"]: m for m in got}  # later attempts' rows come later: they win
    began = _t(attempts(up, job_id)[0]["started_at"])
    return sum(m["step_time_s"] for m in newest.values()) / (_t(job["finished_at"]) - began)


def run_baseline(hosts: Hosts, up: Up) -> dict[str, Any]:
    """The same job as `loss+spare`'s with no fault: the share of its time spent training
    that start-up and checkpoints alone leave."""
    job_id = submit(up, DRILLS["loss+spare"][0])
    job = finish(up, job_id)
    if job["state"] != "SUCCEEDED":
        raise RuntimeError(f"baseline: job {job_id} {job['state']}: {job['error']}")
    return {"drill": "no fault", "job": job_id,
            "effective": effective(up, job_id, job, steps(up, job_id))}


PROBE_EVERY_S = 10.0


def run_slow_link(hosts: Hosts, up: Up) -> dict[str, Any]:
    """A dp job over the three hosts probing every `PROBE_EVERY_S`; rank 2's host limited to
    40 Mbit/s each way once a round during training ran: seconds until the host is named (a
    `slow_link` event), and until it is cleared once the limit is lifted (`link_ok`)."""
    job_id = submit(up, {**dp_job("slow-link", 3, steps=STEPS, every=EVERY), "train": {
        "steps": 100_000, "global_batch": 12, "micro_batch": 2, "precision": "fp32"},
        "monitor": {"probe_max_bytes": 1 << 20, "probe_every_s": PROBE_EVERY_S}})

    def probed() -> bool:
        summary = up.get(f"/jobs/{job_id}/comm")["probe_summary"]
        return summary is not None and int(summary.get("round", 0)) >= 1

    wait_for("a probe round during training", probed, 300, up.log)
    host = next(h for h in hosts.hosts if h.address == next(
        r["ip"] for r in attempts(up, job_id)[0]["placement"]["ranks"] if r["rank"] == 2))
    slowed_at = time.time()
    hosts.slow(host, "40mbit")
    try:
        wait_for("the slow link named", lambda: bool(events(up, job_id, "slow_link")), 300,
                 up.log)
    finally:
        hosts.unslow(host)
    healed_at = time.time()
    wait_for("the link healthy again", lambda: bool(events(up, job_id, "link_ok")), 300,
             up.log)
    named, ok = events(up, job_id, "slow_link")[0], events(up, job_id, "link_ok")[0]
    HTTP.post(f"{up.server}/api/v1/jobs/{job_id}/cancel", headers=up.auth,
              timeout=30).raise_for_status()
    finish(up, job_id)
    return {"drill": "slow link", "job": job_id, "detect_s": _t(named["time"]) - slowed_at,
            "cleared_s": _t(ok["time"]) - healed_at, "named": named["data"]["address"],
            "right_host": named["data"]["address"] == host.address}


def run_drill(hosts: Hosts, up: Up, name: str) -> dict[str, Any]:
    """One run of drill `name`: its figures, with the cluster restored after it."""
    spec, fault = DRILLS[name]
    job_id = submit(up, spec)
    wait_for(f"step {FAULT_AT}", lambda: any(m["step"] >= FAULT_AT
                                             for m in steps(up, job_id)), 300, up.log)
    host = _rank1_host(hosts, up, job_id)
    fault_at = time.time()
    restore = fault(hosts, up, host)
    try:
        wait_for("a step after the fault", lambda: any(
            m["attempt"] >= 2 for m in steps(up, job_id)), 300, up.log)
    finally:
        restore()
    job = finish(up, job_id)
    if job["state"] != "SUCCEEDED":
        raise RuntimeError(f"{name}: job {job_id} {job['state']}: {job['error']}")
    all_joined(hosts, up)
    got = steps(up, job_id)
    by_attempt = stored_once(got, STEPS)
    first = attempts(up, job_id)[0]
    after = min(_t(m["time"]) for m in got if m["attempt"] >= 2)
    return {"drill": name, "job": job_id, "detect_s": _t(first["ended_at"]) - fault_at,
            "first_step_s": after - fault_at,
            "redone": by_attempt[1][-1] - (by_attempt[2][0] - 1),
            "effective": effective(up, job_id, job, got), "attempts": len(by_attempt)}


def _med(runs: list[dict[str, Any]], key: str, fmt: str,
         worst: Callable[[list[float]], float] = max) -> str:
    values = [float(r[key]) for r in runs]
    return f"{statistics.median(values):{fmt}} (worst {worst(values):{fmt}})"


def table(runs: list[dict[str, Any]]) -> str:
    """The median (and the worst) of each figure per drill, as a Markdown table."""
    lines = ["| drill | runs | detect s | first step s | steps redone | effective |",
             "|---|---|---|---|---|---|"]
    base = [r for r in runs if r["drill"] == "no fault"]
    if base:
        lines.append(f"| no fault | {len(base)} | - | - | - |"
                     f" {_med(base, 'effective', '.2f', min)} |")
    for name in DRILLS:
        rs = [r for r in runs if r["drill"] == name]
        if not rs:
            continue
        lines.append(f"| {name} | {len(rs)} | {_med(rs, 'detect_s', '.1f')} |"
                     f" {_med(rs, 'first_step_s', '.1f')} | {_med(rs, 'redone', '.0f')} |"
                     f" {_med(rs, 'effective', '.2f', min)} |")
    slow = [r for r in runs if r["drill"] == "slow link"]
    if slow:
        right = sum(r["right_host"] for r in slow)
        lines.append(f"| slow link (probe every {PROBE_EVERY_S:g} s) | {len(slow)} |"
                     f" {_med(slow, 'detect_s', '.1f')}, the right host {right}/{len(slow)}"
                     f" | - | - | - |")
    return "\n".join(lines)


def write_docs(text: str, path: Path = ROOT / "docs" / "reliability.md") -> None:
    doc = path.read_text()
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="Runs of each drill.")
    p.add_argument("--drill", action="append", choices=sorted([*DRILLS, "slow link"]),
                   help="Only this drill (again for more); default every drill.")
    p.add_argument("--docs", action="store_true", help="Write the table into"
                   " docs/reliability.md.")
    p.add_argument("--ray-defaults", action="store_true", help="The head with Ray's own"
                   " health-check settings, not Trident's (prints; never writes the docs).")
    args = p.parse_args(argv)
    if (why := available()) is not None:
        print(f"bench.chaos: cannot make hosts here: {why}", file=sys.stderr)
        return 2
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp, \
            up_on_hosts(Path(tmp), 3, RAY_DEFAULTS if args.ray_defaults else None) as (
                hosts, up):
        for i in range(args.runs):
            base = run_baseline(hosts, up)
            runs.append({**base, "run": i + 1})
            print(json.dumps(base), flush=True)
            for name in args.drill or [*DRILLS, "slow link"]:
                run = (run_slow_link(hosts, up) if name == "slow link"
                       else run_drill(hosts, up, name))
                runs.append({**run, "run": i + 1})
                print(json.dumps(run), flush=True)
    out = ROOT / "var" / "bench" / ("chaos-ray-defaults.json" if args.ray_defaults
                                     else "chaos.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(runs, indent=2))
    text = table(runs)
    print(text)
    if args.docs and not args.ray_defaults:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
