"""Custom per-rank entry points for the end-to-end tests (`tests.entrypoints:NAME`)."""

from __future__ import annotations

from typing import Any


def explode(ctx: Any) -> None:
    if ctx.rank == 1:
        raise RuntimeError("rank 1 exploded on purpose")


def leaky(ctx: Any) -> None:
    """Prints its secret TRIDENT_TEST_SECRET to stdout and stderr, as a library that names
    what it could not reach does, then fails with it in its exception: what the rank logs
    and the job's error must hold redacted."""
    import os
    import sys

    value = os.environ["TRIDENT_TEST_SECRET"]
    print(f"leaky rank {ctx.rank} stdout: connecting with {value}", flush=True)
    print(f"leaky rank {ctx.rank} stderr: retrying {value}", file=sys.stderr, flush=True)
    raise ConnectionError(f"Unable to find address for: {value}")


def chatty(ctx: Any) -> None:
    """Print a line and report a step every 0.2 s until asked to stop (or 1,500 steps): a
    job that is running, with live output, for as long as a test needs one."""
    import time

    for step in range(1, 1501):
        if ctx.should_stop():
            return
        print(f"chatty rank {ctx.rank} step {step}", flush=True)
        ctx.report({"rank": ctx.rank, "step": step, "loss": 1.0 / step, "step_time_s": 0.2,
                    "tokens_per_s": 1000.0})
        time.sleep(0.2)


def flaky(ctx: Any) -> None:
    """Attempt 1 prints, waits for the file named by TRIDENT_TEST_GO (the test's signal, at
    most an hour) and fails; attempt 2 prints and ends: a job whose rank logs move on to a newer
    attempt while a page follows them."""
    import os
    import time

    print(f"flaky rank {ctx.rank} attempt {ctx.attempt}", flush=True)
    if ctx.attempt == 1:
        deadline = time.monotonic() + 3600
        while not os.path.exists(os.environ["TRIDENT_TEST_GO"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        raise RuntimeError("flaky: attempt 1 fails on purpose")


def rows(ctx: Any) -> None:
    """Report, in one step's `custom` values, the row of the plan this rank was sent: its
    coordinates, its layers, every stage's layers and its groups."""
    import json

    row = ctx.plan
    ctx.report({"rank": ctx.rank, "step": 1, "loss": 1.0, "step_time_s": 0.1,
                "tokens_per_s": 1.0, "custom": {
                    "coords": json.dumps([row.pp, row.dp, row.tp]),
                    "layers": json.dumps(row.layers), "stages": json.dumps(row.stages),
                    "groups": json.dumps({str(d): g for d, g in row.groups.items()})}})


def tracked(ctx: Any) -> None:
    """The tracking test's job: checks that its secret reached this rank's environment as
    submitted (by its digest, never printing it) and that the server's own tracker token did
    not, then reports a step every 0.2 s, with a custom metric, until the file named by
    TRIDENT_TEST_GO exists on any rank (the test's signal; at most an hour), and 3 more. Run
    by light ranks (`program: light`): their context's `any` is the collective that tells."""
    import hashlib
    import os
    import time

    value = os.environ.get("TRIDENT_TEST_SECRET")
    digest = hashlib.sha256((value or "").encode()).hexdigest()
    if value is None or digest != os.environ["TRIDENT_TEST_SECRET_SHA256"]:
        raise RuntimeError("the secret TRIDENT_TEST_SECRET is not in this rank's environment"
                           " as it was submitted")
    if "TRIDENT_MLFLOW_TOKEN" in os.environ or "MLFLOW_TRACKING_TOKEN" in os.environ:
        raise RuntimeError("the server's MLflow token reached a rank")
    print(f"tracked rank {ctx.rank}: its secret is in its environment ({len(value)} chars)",
          flush=True)
    deadline, last, more = time.monotonic() + 3600, time.monotonic(), None
    for step in range(1, 20_000):
        if ctx.should_stop():
            return
        time.sleep(0.2)
        now = time.monotonic()
        ctx.report({"rank": ctx.rank, "step": step, "loss": 5.0 / step ** 0.5,
                    "step_time_s": now - last, "tokens_per_s": 2048 / (now - last),
                    "custom": {"accuracy": 1 - 1 / (step + 1)}})
        last = now
        if more is None and ctx.any(os.path.exists(os.environ["TRIDENT_TEST_GO"])
                                    or now > deadline):
            more = 3
        if more is not None:
            more -= 1
            if more == 0:
                return


def ds_config_dump(ctx: Any) -> None:
    """Write the DeepSpeed config the built-in trainer would pass to `deepspeed.initialize`
    to $TRIDENT_TEST_DS_CONFIG (rank 0), with what an engine made from it reads back."""
    import json
    import os

    import torch

    from workers.runtime.deepspeed_import import deepspeed

    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ctx.ds_config)
    read_back = {"reduce_bucket_size": engine.zero_reduce_bucket_size(),
                 "overlap_comm": engine.zero_overlap_comm(),
                 "communication_data_type": str(engine.communication_data_type)}
    engine.destroy()
    if ctx.rank == 0:
        with open(os.environ["TRIDENT_TEST_DS_CONFIG"], "w") as f:
            json.dump({"config": ctx.ds_config, "engine": read_back}, f)
    ctx.report({"rank": ctx.rank, "step": 1, "step_time_s": 0.1, "tokens_per_s": 1.0})
