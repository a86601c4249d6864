"""Fit the `cpu` profile's overheads to the real trainer, run as a user runs it: through the
controller and the Ray worker group (monitor on), 2 CPU ranks, gloo, ZeRO-2, fp32.

For several depths of gpt-tiny it measures the median step time (first step left out),
fits `layer_overhead_s` and `step_overhead_s` (`service.planner.calibrate.fit_overheads`)
and prints predicted against measured, before and after the fit.

Run: python bench/bench_cpu_trainer.py [layers ...]      (about a minute per depth on 2 cores)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

from service.controller import Controller
from service.jobs import prepare
from service.planner import evaluate
from service.planner.calibrate import fit_overheads
from service.spec import JobSpec
from service.store import Store
from workers.group import RayLauncher

STEPS = 20


def spec_for(layers: int) -> JobSpec:
    return JobSpec.model_validate({
        "name": f"calib-{layers}", "model": {"preset": "gpt-tiny", "layers": layers},
        "train": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        "parallel": {"dp": 2, "zero": 2}, "monitor": {"probe": False},
        "resources": {"cpus_per_worker": 1}})


def measure(store: Store, controller: Controller, spec: JobSpec) -> float:
    p = prepare(spec)
    job_id = store.create_job(name=spec.name, spec=spec.model_dump(mode="json"), plan=p.plan,
                              world_size=p.world_size, cpus=p.cpus, gpus=p.gpus).id
    while not store.get_job(job_id=job_id).state.terminal:
        controller.step()
        time.sleep(0.2)
    assert store.get_job(job_id=job_id).state == "SUCCEEDED", store.get_job(job_id=job_id).error
    return statistics.median(m.step_time_s for m in store.list_metrics(job_id=job_id)
                             if m.step > 1)


def main(depths: list[int]) -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tmp = Path(tempfile.mkdtemp())
    store = Store(f"sqlite:///{tmp / 'calib.db'}")
    store.migrate()
    controller = Controller(store, RayLauncher(), checkpoint_root=tmp)
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
    controller.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2, 4, 8])
