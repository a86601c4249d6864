"""What orchestration costs: the same trainer and spec under `torchrun -m workers.trainer.train`,
under Trident (API, controller, Ray actors, monitor on), and in two plain Ray actors with
nothing of Trident around them (`bench/_ray_ranks.py`), running the trainer in their own
processes or each in a child process, alternated (A B C D D C B A ...): the plain-Ray sides
split Trident's cost into Ray's own, and Ray's into its head and its runtime inside a rank's
process.

Two specs, two CPU ranks each: `tiny` (the demo's model) and `medium` (a step takes about
0.5 s on this kind of machine). Per run: the steady-state step time (median of rank 0's steps
past the warm-up, as the trainer measures them under both), and the time to the first step,
from launching torchrun (until rank 0 prints its first step) against from submitting to a
running, idle stack (until the first step's row; the stack itself is started once, before, as
it runs all the time). Trident's time to first step is split into named stages by its job's
events: admission (queued -> PLACING), placement group (-> `placement`), actor start and
rendezvous (-> `rendezvous`: actors up, libraries imported, ranks launched), the bandwidth
probe (-> `probe`), and DeepSpeed init, the first step and its report reaching the store
(-> the first metric row, whose lag includes a controller poll).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.auth import token_file_headers
from bench.control_plane import _port, _stop, _wait_http
from bench.harness import Section, dist, fmt_dist, fmt_s

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3
POLL_S = 1.0
"""How often the bench asks for the job's state while it runs, as someone watching it would
(`trident status --watch` asks every 2 s, the job page every 2 s). Every answer is read
from the store, not from the ranks; at 0.25 s, the API's share of a core took 2 to 3 % of
a tiny job's speed on this two-core kind of machine, where torchrun's ranks had no one asking."""
SPEED_GOAL = 0.98
"""Issue 25's goal: Trident's steady-state step at 0.98 of torchrun's speed or better."""
FIRST_STEP_GOAL_S = 2.0
"""Issue 25's goal: Trident's first step at most 2 s after torchrun's."""


def specs(quick: bool) -> dict[str, dict[str, Any]]:
    base = {"parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 2},
            "resources": {"gpus_per_worker": 0, "cpus_per_worker": 1}}
    tiny = {"name": "tiny", "model": {"preset": "gpt-tiny"},
            "train": {"steps": 12 if quick else 200, "global_batch": 8, "micro_batch": 2,
                      "precision": "fp32", "lr": 0.003}, **base}
    medium = {"name": "medium", "model": {"preset": "gpt-tiny", "layers": 4, "hidden": 256,
                                          "heads": 4, "seq_len": 128, "vocab": 1024},
              "train": {"steps": 20, "global_batch": 16, "micro_batch": 4,
                        "precision": "fp32"}, **base}
    return {"tiny": tiny} if quick else {"tiny": tiny, "medium": medium}


def _spec_file(spec: dict[str, Any], work: Path) -> Path:
    path = work / f"{spec['name']}.json"
    path.write_text(json.dumps(spec))
    return path


def _step_time(line: str) -> float | None:
    """The step time of a step line the trainer's rank 0 prints, None for any other line."""
    if line.startswith("{") and '"step"' in line:
        return float(json.loads(line)["step_time_s"])
    return None


def torchrun(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    path = _spec_file(spec, work)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(_port()), "-m", "workers.trainer.train", "--spec", str(path)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                            start_new_session=True)
    first = None
    steps: list[float] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if (step := _step_time(line)) is not None:
            if first is None:
                first = time.perf_counter() - t0
            steps.append(step)
    rc = proc.wait(600)
    if rc != 0 or first is None:
        raise RuntimeError(f"torchrun exited {rc} after {len(steps)} steps")
    return {"first_step_s": first, "step_s": _steady(steps), "steps": len(steps),
            "wall_s": time.perf_counter() - t0}


def plain_ray(spec: dict[str, Any], work: Path, mode: str = "inproc") -> dict[str, Any]:
    """The same trainer and spec in two plain Ray actors on a Ray head of their own
    (`bench/_ray_ranks.py`), in the actors' processes (`inproc`) or in a child process of
    each (`child`): Ray's cost to the ranks without Trident. Steady-state step only (its time
    to first step includes starting that head)."""
    path = _spec_file(spec, work)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "_ray_ranks.py"), mode,
                          str(path), str(_port())], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         start_new_session=True)
    steps = [step for line in out.stdout.splitlines()
             if (step := _step_time(line)) is not None]
    if out.returncode != 0 or not steps:
        raise RuntimeError(f"plain Ray ({mode}) exited {out.returncode} after {len(steps)}"
                           f" steps: {out.stderr[-2000:]}")
    return {"step_s": _steady(steps), "steps": len(steps)}


def _steady(xs: list[float]) -> float:
    import statistics
    return statistics.median(xs[WARMUP:] or xs)


class Stack:
    """`trident up` on a scratch data dir (SQLite, its own local Ray head), stopped with
    --stop-jobs (its head with it)."""

    def __init__(self, work: Path) -> None:
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}/api/v1"
        self.log = work / "stack.log"
        self.data_dir = work / "data"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "up", "--port", str(self.port), "--data-dir",
             str(work / "data"), "--stop-jobs"], cwd=ROOT, stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})

    def wait(self) -> None:
        import httpx
        _wait_http(f"{self.url}/jobs?limit=1", 120, self.proc, self.log)
        end = time.monotonic() + 120
        while httpx.get(f"{self.url}/healthz", timeout=5).status_code != 200:
            if time.monotonic() > end:
                raise TimeoutError(f"no controller: {self.log.read_text()[-2000:]}")
            time.sleep(0.5)

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        import httpx

        c = httpx.Client(base_url=self.url, timeout=30,
                         headers=token_file_headers(self.data_dir))
        submitted = time.time()
        r = c.post("/jobs", json=spec)
        assert r.status_code == 201, r.text[:500]
        job = r.json()["id"]
        end = time.monotonic() + 600
        while (state := c.get(f"/jobs/{job}").json()["state"]) not in (
                "SUCCEEDED", "FAILED", "CANCELLED"):
            if time.monotonic() > end:
                raise TimeoutError(f"job {job} still {state}")
            time.sleep(POLL_S)
        events = c.get(f"/jobs/{job}/events", params={"limit": 1000}).json()["items"]
        metrics = c.get(f"/jobs/{job}/metrics").json()["items"]
        if state != "SUCCEEDED":
            raise RuntimeError(f"job {job} {state}: {[e['message'][-300:] for e in events]}")
        return stages(submitted, events, metrics)

    def stop(self) -> None:
        _stop(self.proc, 90)


def _t(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def stages(submitted: float, events: list[dict[str, Any]],
           metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Trident's time to first step, split by the job's events."""
    def at(pred: Any) -> float | None:
        return next((_t(e["time"]) for e in events if pred(e)), None)

    marks = [("admission", at(lambda e: e["kind"] == "state"
                              and e["data"].get("to") == "PLACING")),
             ("placement group", at(lambda e: e["kind"] == "placement")),
             ("actor start and rendezvous", at(lambda e: e["kind"] == "rendezvous")),
             ("probe", at(lambda e: e["kind"] == "probe")),
             ("DeepSpeed init, first step and its report",
              _t(metrics[0]["time"]) if metrics else None)]
    out: dict[str, float] = {}
    prev = submitted
    for name, t in marks:
        if t is None:
            continue
        out[name] = t - prev
        prev = t
    running = at(lambda e: e["kind"] == "state" and e["data"].get("to") == "RUNNING")
    steps = [m["step_time_s"] for m in metrics]
    return {"first_step_s": prev - submitted, "stages": out,
            "submit_to_running_s": None if running is None else running - submitted,
            "step_s": _steady(steps), "steps": len(steps)}


def run(sec: Section, quick: bool, dbs: tuple[str, ...] = ()) -> None:
    work = Path(tempfile.mkdtemp(prefix="trident-bench-orch-"))
    stack = Stack(work)
    try:
        stack.wait()
        reps = 1 if quick else 4  # each side's median of four runs
        for name, spec in specs(quick).items():
            tr: list[dict[str, Any]] = []
            td: list[dict[str, Any]] = []
            rr: list[dict[str, Any]] = []
            rc: list[dict[str, Any]] = []
            sides = [lambda spec=spec, tr=tr: tr.append(torchrun(spec, work)),
                     lambda spec=spec, td=td: td.append(stack.run(spec)),
                     lambda spec=spec, rr=rr: rr.append(plain_ray(spec, work)),
                     lambda spec=spec, rc=rc: rc.append(plain_ray(spec, work, "child"))]
            for i in range(reps):  # A B C D, D C B A: load drift falls on all alike
                for side in sides if i % 2 == 0 else sides[::-1]:
                    side()
            _report(sec, name, tr, td, rr, rc)
    finally:
        stack.stop()


def _report(sec: Section, name: str, tr: list[dict[str, Any]], td: list[dict[str, Any]],
            rr: list[dict[str, Any]], rc: list[dict[str, Any]]) -> None:
    import statistics

    speed = [x["step_s"] / y["step_s"] for x, y in zip(tr, td, strict=True)]
    ray_speed = [x["step_s"] / y["step_s"] for x, y in zip(tr, rr, strict=True)]
    over_ray = [x["step_s"] / y["step_s"] for x, y in zip(rr, td, strict=True)]
    child_speed = [x["step_s"] / y["step_s"] for x, y in zip(tr, rc, strict=True)]
    tr_first = dist([x["first_step_s"] for x in tr])
    td_first = dist([y["first_step_s"] for y in td])
    extra = td_first["median"] - tr_first["median"]
    stage_names = list(td[0]["stages"])
    stage_med = {s: statistics.median(y["stages"].get(s, 0.0) for y in td) for s in stage_names}
    to_running = [y["submit_to_running_s"] for y in td if y["submit_to_running_s"] is not None]
    sec.figures[name] = {"torchrun": tr, "trident": td, "speed_ratio": dist(speed),
                         "plain_ray": rr, "plain_ray_speed_ratio": dist(ray_speed),
                         "trident_over_plain_ray": dist(over_ray),
                         "ray_child": rc, "ray_child_speed_ratio": dist(child_speed),
                         "first_step": {"torchrun": tr_first, "trident": td_first,
                                        "extra_s": extra, "stages": stage_med},
                         "submit_to_running": dist(to_running)}
    sec.row(f"{name}: steady-state speed, Trident / torchrun",
            f"{statistics.median(speed):.3f}",
            f"step torchrun {fmt_dist(dist([x['step_s'] for x in tr]))}; Trident "
            f"{fmt_dist(dist([y['step_s'] for y in td]))}; pairs {len(speed)}")
    sec.row(f"{name}: steady-state speed, plain Ray actors / torchrun",
            f"{statistics.median(ray_speed):.3f}",
            f"step {fmt_dist(dist([y['step_s'] for y in rr]))}; Trident / plain Ray"
            f" {statistics.median(over_ray):.3f} (what Trident adds to Ray's cost)")
    sec.row(f"{name}: steady-state speed, plain Ray actors each starting its rank as a child"
            " process / torchrun", f"{statistics.median(child_speed):.3f}",
            f"step {fmt_dist(dist([y['step_s'] for y in rc]))}: Ray's head beside the ranks,"
            " no Ray inside their processes")
    sec.row(f"{name}: time to first step", f"Trident +{extra:.1f} s",
            f"torchrun {fmt_dist(tr_first)}; Trident {fmt_dist(td_first)}; stages: "
            + ", ".join(f"{s} {fmt_s(v)}" for s, v in stage_med.items()))
    if to_running:
        sec.row(f"{name}: Trident submit to RUNNING, idle cluster", fmt_dist(dist(to_running)),
                "queued -> all ranks running (events)")
    sec.goal(f"{name}: speed vs torchrun", statistics.median(speed), f">= {SPEED_GOAL}",
             statistics.median(speed) >= SPEED_GOAL)
    sec.goal(f"{name}: extra time to first step (s)", extra, f"<= {FIRST_STEP_GOAL_S:g}",
             extra <= FIRST_STEP_GOAL_S)
