"""Fit the `cpu` profile's overheads to the real trainer, run as a user runs it: through the
controller and the Ray worker group (monitor on), 2 CPU ranks, gloo, ZeRO-2, fp32.

For several depths of gpt-tiny it measures the median step time (first step left out),
fits `layer_overhead_s` and `step_overhead_s` (`service.planner.calibrate.fit_overheads`)
and prints predicted against measured, before and after the fit.

`--demo` runs the demo job (examples/tiny.yaml, as `make demo` does) once and prints its
`predicted_vs_measured`: the step time, tokens/s and model-state bytes the plan predicted next
to the steady-state medians the ranks reported (service.views.prediction). The step-time ratio moves
with the machine's load, so it is tracked here rather than asserted by a test.

Run: python bench/bench_cpu_trainer.py [layers ...]      (about a minute per depth on 2 cores)
     python bench/bench_cpu_trainer.py --demo            (about two minutes on 2 cores)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import yaml

from service.contract.spec import JobSpec
from service.control.controller import Controller
from service.planner import evaluate
from service.planner.calibrate import fit_overheads
from service.store import Store
from service.submission.intake import submit
from service.views.prediction import compare
from workers.launch.launcher import RayLauncher

STEPS = 20
DEMO_SPEC = Path(__file__).resolve().parent.parent / "examples" / "tiny.yaml"


def spec_for(layers: int) -> JobSpec:
    return JobSpec.model_validate({
        "name": f"calib-{layers}", "model": {"preset": "gpt-tiny", "layers": layers},
        "train": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        "parallel": {"dp": 2, "zero": 2}, "monitor": {"probe": False},
        "resources": {"cpus_per_worker": 1}})


def run_job(store: Store, controller: Controller, spec: JobSpec) -> int:
    """Submit `spec`, drive the controller until the job ends; the job's id (it succeeded)."""
    job_id = submit(store, spec).id
    while not store.get_job(job_id=job_id).state.terminal:
        controller.step()
        time.sleep(0.2)
    assert store.get_job(job_id=job_id).state == "SUCCEEDED", store.get_job(job_id=job_id).error
    return job_id


def measure(store: Store, controller: Controller, spec: JobSpec) -> float:
    job_id = run_job(store, controller, spec)
    return statistics.median(m.step_time_s for m in store.list_metrics(job_id=job_id)
                             if m.step > 1)


def start() -> tuple[Store, Controller]:
    # "local": a new Ray of its own, never one that `ray start` left on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    tmp = Path(tempfile.mkdtemp())
    store = Store(f"sqlite:///{tmp / 'calib.db'}")
    store.migrate()
    return store, Controller(store, RayLauncher(), checkpoint_root=tmp)


def demo() -> None:
    """The demo job once: predicted against measured, as `GET /jobs/{id}` serves it."""
    spec = JobSpec.model_validate(yaml.safe_load(DEMO_SPEC.read_text()))
    store, controller = start()
    job_id = run_job(store, controller, spec)
    pvm = compare(store.get_job(job_id=job_id).plan, store.list_metrics(job_id=job_id))
    controller.shutdown(stop_jobs=True)
    ray.shutdown()
    print(f"{spec.name}: {pvm['steps_measured']} steady-state steps")
    print(f"{'':<18} {'predicted':>12} {'measured':>12} {'measured/predicted':>19}")
    for key in ("step_s", "tokens_per_s", "model_state_bytes"):
        row = pvm[key]
        print(f"{key:<18} {row['predicted']:>12.4g} {row['measured']:>12.4g}"
              f" {row['ratio']:>19.3f}")


def main(depths: list[int]) -> None:
    store, controller = start()
    samples = []
    for layers in depths:
        spec = spec_for(layers)
        samples.append((evaluate(spec), measure(store, controller, spec)))
    fitted = fit_overheads(samples)
    print(f"fitted: layer_overhead_s={fitted.layer_overhead_s:.3e}"
          f" step_overhead_s={fitted.step_overhead_s:.3e}")
    print(f"{'layers':>6} {'measured s':>11} {'predicted':>10} {'err':>7} {'refit':>10} {'err':>7}")
    for (plan, measured), layers in zip(samples, depths, strict=True):
        refit = evaluate(spec_for(layers), profile=fitted).time.step_s
        print(f"{layers:>6} {measured:>11.4f} {plan.time.step_s:>10.4f}"
              f" {plan.time.step_s / measured - 1:>+7.1%} {refit:>10.4f}"
              f" {refit / measured - 1:>+7.1%}")
    controller.shutdown(stop_jobs=True)
    ray.shutdown()


if __name__ == "__main__":
    if sys.argv[1:] == ["--demo"]:
        demo()
    else:
        main([int(a) for a in sys.argv[1:]] or [2, 4, 8])
