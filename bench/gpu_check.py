"""The GPU check: one run that proves the GPU paths on a machine with CUDA GPUs, one JSON report.

`make gpu-check` or `python bench/gpu_check.py [--out var/bench/gpu_check.json] [--budget-s 480]`

Steps, each guarded by a timeout (a hang is reported as `timeout` with the step's name and the
tail of its output, and the check goes on with the next step):

- `build`: the torch build `make install` left (CUDA or CPU), CUDA version, devices, NCCL
  version (`torch.cuda.nccl.version()`).
- `topology`: `nvidia-smi topo -m`, parsed into {device: {device: link}}.
- `stack`: `trident up` on a scratch data directory (SQLite, its own local Ray head).
- `probe`: `trident probe` on the GPUs: matmul TFLOP/s (bf16) and the calibrated profile.
- `calibrate`: `trident probe --calibrate`: the probe again, then the calibration jobs (the
  built-in trainer, one GPU each, bf16, four sizes: `service.planner.calibrate`) through the
  whole stack; the trident stack's efficiency and overheads fitted to their step times, and
  the plan of a job on this GPU with those constants marked `measured` (so the first run on a
  GPU profile measures what the planner otherwise assumes).
- `train_bf16`, `train_fp16`: the built-in trainer (`workers.trainer.train.train_rank`) on one GPU
  for a 1.1B-parameter Llama-style GPT, 20 steps (fp16 with DeepSpeed's dynamic loss
  scaling): step time, tokens/s, MFU, `torch.cuda.max_memory_allocated` and
  `max_memory_reserved`, next to the plan's prediction for the same spec.
- `guards`: the training guard (docs/guards.md) on one GPU in bf16: a NaN loss skipped, three
  in a row rolled back to the newest checkpoint, their batches passed over.
- `profile`: `trident profile --memory`'s profiler on one GPU: CUDA kernels in the trace, the
  memory timeline and the CUDA memory snapshot (`workers.monitor.profiler`).
- with two or more GPUs: `nccl_probe` (all-reduce bus bandwidth over NCCL), `job_tp2` (bf16
  at tp2) and `job_dp2_zero2` through the whole stack (API, controller, Ray) with their
  `/comm` report, whose times come from CUDA events.

On a machine without CUDA every GPU step is `skipped` with the reason, so the script runs (and
is tested) anywhere. Steps that run code on the GPU run in a child process of their own, so a
hung CUDA call cannot hang the check: the child is killed at its timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULT = "GPU_CHECK_RESULT "
"""Prefix of the line in which a child step prints its result."""

from bench.gpu_steps import (  # noqa: E402
    CHILD_STEPS,
    MODEL_SMALL,
    TRAIN_STEPS,
    _free_port,
    gpu_profile_name,
)

# --- the parent: runs every step under its timeout ---

class Check:
    def __init__(self, budget_s: float, work: Path, step_timeout_s: float | None = None) -> None:
        self.step_timeout_s = step_timeout_s
        self.deadline = time.monotonic() + budget_s
        self.work = work
        self.steps: list[dict[str, Any]] = []
        self.stack: subprocess.Popen[bytes] | None = None
        self.server = ""
        self.data_dir = self.work

    def left(self, want: float) -> float:
        want = min(want, self.step_timeout_s or want)
        return max(1.0, min(want, self.deadline - time.monotonic()))

    def record(self, name: str, status: str, t0: float, **fields: Any) -> dict[str, Any]:
        row = {"name": name, "status": status, "seconds": round(time.monotonic() - t0, 3),
               **fields}
        self.steps.append(row)
        msg = fields.get("reason") or fields.get("error") or ""
        print(f"[gpu-check] {name}: {status} ({row['seconds']:.1f} s) {msg}".rstrip(),
              file=sys.stderr, flush=True)
        return row

    def skip(self, name: str, reason: str) -> None:
        self.record(name, "skipped", time.monotonic(), reason=reason)

    def child(self, name: str, timeout_s: float) -> dict[str, Any] | None:
        """Run CHILD_STEPS[name] in a process of its own, killed at its timeout."""
        t0 = time.monotonic()
        timeout_s = self.left(timeout_s)
        proc = subprocess.Popen([sys.executable, __file__, "--step", name], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, env=_env())
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, _ = proc.communicate()
            self.record(name, "timeout", t0, error=f"hung: {name} did not finish within"
                        f" {timeout_s:.0f} s; killed", output_tail=_tail(out))
            return None
        text = out.decode(errors="replace")
        for line in reversed(text.splitlines()):
            if line.startswith(RESULT):
                result: dict[str, Any] = json.loads(line[len(RESULT):])
                self.record(name, "ok", t0, result=result)
                return result
        self.record(name, "failed", t0, error=f"exit status {proc.returncode}",
                    output_tail=_tail(out))
        return None

    def guarded(self, name: str, timeout_s: float, fn: Callable[[float], dict[str, Any]]) -> None:
        """Run fn(timeout) on a thread of this process, abandoned at its timeout (fn's own
        calls are bounded too: HTTP timeouts, subprocess timeouts, polling deadlines)."""
        t0 = time.monotonic()
        timeout_s = self.left(timeout_s)
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = fn(timeout_s)
            except Exception as exc:  # reported, and the check goes on
                box["error"] = f"{type(exc).__name__}: {exc}"

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        t.join(timeout_s + 5)
        if t.is_alive():
            self.record(name, "timeout", t0, error=f"hung: {name} did not finish within"
                        f" {timeout_s:.0f} s")
        elif "error" in box:
            self.record(name, "failed", t0, error=box["error"])
        else:
            self.record(name, "ok", t0, result=box["result"])

    # --- steps on the parent ---------------------------------------------------------------------

    def topology(self, timeout_s: float) -> dict[str, Any]:
        from service.cluster.inventory import parse_topo_matrix

        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                             timeout=timeout_s, check=True).stdout
        matrix = parse_topo_matrix(out)
        gpus = [d for d in matrix if d.startswith("GPU")]
        links = {f"{a}-{b}": matrix[a].get(b) for a in gpus for b in gpus if a < b}
        return {"matrix": matrix, "gpu_links": links,
                "nvlink_pairs": sum(1 for v in links.values() if v and v.startswith("NV"))}

    def auth(self) -> dict[str, str]:
        """The stack's bootstrap admin (`trident up` wrote its token to the data dir)."""
        from bench.auth import token_file_headers

        return token_file_headers(self.data_dir)

    def start_stack(self, timeout_s: float) -> dict[str, Any]:
        import httpx

        port = _free_port()
        data = self.work / "stack"
        log = open(self.work / "stack.log", "wb")  # noqa: SIM115 (kept open for the child)
        self.stack = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "up", "--port", str(port), "--data-dir", str(data),
             "--stop-jobs"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=_env(TRIDENT_ALLOW_FAULTS="0"))
        self.server = f"http://127.0.0.1:{port}"
        self.data_dir = data
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.stack.poll() is not None:
                raise RuntimeError(f"trident up exited ({self.stack.returncode}): "
                                   f"{_tail((self.work / 'stack.log').read_bytes())}")
            try:
                r = httpx.get(f"{self.server}/api/v1/healthz", timeout=5)
                if r.status_code == 200:
                    return {"server": self.server, "health": r.json()}
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"the stack did not become healthy within {timeout_s:.0f} s")

    def probe(self, timeout_s: float, gpus: int, profile: str) -> dict[str, Any]:
        import httpx

        cmd = [sys.executable, "-m", "cli.main", "probe", "--server", self.server,
               "--ranks-per-node", str(gpus), "--profile", profile, "--timeout",
               str(int(timeout_s) - 5)]
        token = self.auth()["Authorization"].removeprefix("Bearer ")
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                             env=_env(TRIDENT_TOKEN=token))
        if out.returncode != 0:
            raise RuntimeError(f"trident probe failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        auth = self.auth()
        cluster = httpx.get(f"{self.server}/api/v1/cluster", headers=auth, timeout=10).json()
        probes = httpx.get(f"{self.server}/api/v1/probes", headers=auth, timeout=10).json()[
            "items"]
        summary = probes[0].get("summary", {}) if probes else {}
        flops = summary.get("matmul_flops", {})
        return {"output": out.stdout[-4000:],
                "matmul_tflops": {k: v / 1e12 for k, v in flops.items()},
                "calibrated_profile": cluster.get("profiles")}

    def calibrate(self, timeout_s: float, gpus: int, profile: str) -> dict[str, Any]:
        """`trident probe --calibrate`; the fitted constants, and a plan's `constants`."""
        import httpx

        cmd = [sys.executable, "-m", "cli.main", "probe", "--server", self.server,
               "--ranks-per-node", str(gpus), "--profile", profile, "--calibrate",
               "--timeout", str(int(timeout_s) - 10)]
        token = self.auth()["Authorization"].removeprefix("Bearer ")
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                             env=_env(TRIDENT_TOKEN=token))
        if out.returncode != 0:
            raise RuntimeError(f"trident probe --calibrate failed: {out.stdout[-2000:]}"
                               f"{out.stderr[-2000:]}")
        api, auth = f"{self.server}/api/v1", self.auth()
        prof = httpx.get(f"{api}/cluster", headers=auth, timeout=10).json()["profiles"][profile]
        spec = {"name": "gpu-check-plan", "model": MODEL_SMALL,
                "train": {"steps": TRAIN_STEPS, "global_batch": 8, "micro_batch": 2,
                          "precision": "bf16"},
                "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 0},
                "resources": {"gpus_per_worker": 1, "cpus_per_worker": 1},
                "cluster": {"gpu": profile, "nodes": 1, "gpus_per_node": 1}}
        plan = httpx.post(f"{api}/plan", json=spec, headers=auth, timeout=30).json()
        jobs = []
        for job_id in prof["calibration"]["jobs"]:
            job = httpx.get(f"{api}/jobs/{job_id}", headers=auth, timeout=10).json()
            jobs.append({"job": job_id, "name": job["name"],
                         "predicted_vs_measured": job.get("predicted_vs_measured")})
        return {"output": out.stdout[-3000:], "calibration": prof["calibration"],
                "layer_overhead_s": prof["layer_overhead_s"],
                "step_overhead_s": prof["step_overhead_s"], "jobs": jobs,
                "plan_step_s": plan["time"]["step_s"], "plan_mfu": plan["mfu"],
                "constants": {k: c["status"] for k, c in plan["constants"].items()}}

    def job(self, timeout_s: float, parallel: dict[str, Any], profile: str) -> dict[str, Any]:
        """A small GPT through the whole stack on two GPUs; its /comm report (CUDA events)."""
        import httpx

        spec = {"name": "gpu-check-" + "-".join(f"{k}{v}" for k, v in parallel.items()),
                "model": MODEL_SMALL,
                "train": {"steps": TRAIN_STEPS, "global_batch": 8, "micro_batch": 2,
                          "precision": "bf16"},
                "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 0, **parallel},
                "resources": {"gpus_per_worker": 1, "cpus_per_worker": 1},
                "cluster": {"gpu": profile, "nodes": 1, "gpus_per_node": 2}}
        api = f"{self.server}/api/v1"
        r = httpx.post(f"{api}/jobs", json=spec, headers=self.auth(), timeout=30)
        r.raise_for_status()
        job_id = r.json()["id"]
        end = time.monotonic() + timeout_s - 10
        state = "queued"
        while time.monotonic() < end:
            state = httpx.get(f"{api}/jobs/{job_id}", headers=self.auth(),
                              timeout=10).json()["state"]
            if state in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(1)
        comm = httpx.get(f"{api}/jobs/{job_id}/comm", headers=self.auth(), timeout=10).json()
        events = httpx.get(f"{api}/jobs/{job_id}/events", headers=self.auth(), timeout=10).json()
        if state != "succeeded":
            httpx.post(f"{api}/jobs/{job_id}/cancel", headers=self.auth(), timeout=10)
            tail = [e.get("message", "")[-500:] for e in events[-5:]] if isinstance(
                events, list) else events
            raise RuntimeError(f"job {job_id} ended {state}; last events: {tail}")
        return {"job": job_id, "state": state, "comm": comm}

    def stop_stack(self) -> None:
        if self.stack is not None and self.stack.poll() is None:
            os.killpg(self.stack.pid, signal.SIGTERM)
            try:
                self.stack.wait(60)
            except subprocess.TimeoutExpired:
                _kill_group(self.stack)
        self.stack = None


def run_check(budget_s: float, step_timeout_s: float | None = None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="trident-gpu-check-"))
    check = Check(budget_s, work, step_timeout_s)
    started = time.time()
    try:
        build = check.child("build", 90) or {}
        gpus = int(build.get("device_count") or 0)
        no_gpu = (f"no CUDA GPU: torch {build.get('torch')} ({build.get('build')} build),"
                  f" torch.cuda.is_available() is {build.get('cuda_available')}")
        profile = gpu_profile_name(build["devices"][0]["name"]) if gpus else "cpu"
        if gpus == 0:
            for name in ("topology", "stack", "probe", "calibrate", "train_bf16", "train_fp16",
                         "guards", "profile"):
                check.skip(name, no_gpu)
        else:
            if shutil.which("nvidia-smi"):
                check.guarded("topology", 30, check.topology)
            else:
                check.skip("topology", "nvidia-smi is not on PATH")
            check.guarded("stack", 90, check.start_stack)
            if check.steps[-1]["status"] == "ok":
                check.guarded("probe", 120, lambda t: check.probe(t, gpus, profile))
                check.guarded("calibrate", 240, lambda t: check.calibrate(t, gpus, profile))
            else:
                check.skip("probe", "the stack did not start")
                check.skip("calibrate", "the stack did not start")
            check.child("train_bf16", 150)
            check.child("train_fp16", 150)
            check.child("guards", 120)
            check.child("profile", 60)
        multi = ("needs two or more CUDA GPUs; this machine has"
                 f" {gpus}" + ("" if gpus else f" ({no_gpu})"))
        if gpus >= 2:
            check.child("nccl_probe", 90)
            stack_up = check.stack is not None and check.stack.poll() is None
            for name, par in (("job_tp2", {"tp": 2}), ("job_dp2_zero2", {"dp": 2, "zero": 2})):
                if stack_up:
                    check.guarded(name, 150, lambda t, p=par: check.job(t, p, profile))
                else:
                    check.skip(name, "the stack did not start")
        else:
            for name in ("nccl_probe", "job_tp2", "job_dp2_zero2"):
                check.skip(name, multi)
    finally:
        check.stop_stack()
        shutil.rmtree(work, ignore_errors=True)
    statuses = [s["status"] for s in check.steps]
    return {"check": "trident gpu-check", "started": time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "seconds": round(time.time() - started, 1), "host": socket.gethostname(),
            "gpus": gpus, "ok": all(s in ("ok", "skipped") for s in statuses),
            "summary": {k: statuses.count(k) for k in ("ok", "skipped", "failed", "timeout")},
            "steps": check.steps}


# --- helpers ---

def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(out: bytes | None, n: int = 3000) -> str:
    return (out or b"").decode(errors="replace")[-n:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "gpu_check.json"))
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="the whole check's time limit (each step's timeout is cut to fit)")
    ap.add_argument("--step-timeout-s", type=float, default=None,
                    help="cut every step's timeout to this")
    ap.add_argument("--step", choices=sorted(CHILD_STEPS), help=argparse.SUPPRESS)
    ap.add_argument("--hang", choices=sorted(CHILD_STEPS), help="make this step hang (to see"
                    " the timeout work: the tests use it)")
    args = ap.parse_args()
    if args.hang:
        os.environ["TRIDENT_GPU_CHECK_HANG"] = args.hang
    if args.step:
        if os.environ.get("TRIDENT_GPU_CHECK_HANG") == args.step:
            time.sleep(3600)
        print(RESULT + json.dumps(CHILD_STEPS[args.step](), default=str), flush=True)
        return
    report = run_check(args.budget_s, args.step_timeout_s)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
