"""The `trident` commands that need no server: `plan`, `capacity`, `validate` (and `plan
--compare JOB`, which asks the server for that job's measurement)."""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Annotated

import typer
from pydantic import TypeAdapter, ValidationError

from cli.common import DEFAULT_SERVER, ServerOpt, fail
from cli.spec import SetOpt, load_spec
from cli.whatif import what_if
from service.contract.hardware import HardwareProfile
from service.contract.prices import ProfilePrice


def local_price(profile: str) -> ProfilePrice | None:
    """This shell's price of `profile` (`TRIDENT_PRICES`, as the server reads it); a value
    that is not prices is a one-line error."""
    raw = os.environ.get("TRIDENT_PRICES", "").strip()
    if not raw:
        return None
    try:
        prices = TypeAdapter(dict[str, ProfilePrice]).validate_json(raw)
    except ValidationError as exc:
        fail("TRIDENT_PRICES: " + "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'value'}: {e['msg']}"
            for e in exc.errors()))
    return prices.get(profile)


def plan(spec: Annotated[Path | None, typer.Argument(
             help="The job spec (with --compare: default the job's own).")] = None,
         sets: SetOpt = None,
         compare: Annotated[int | None, typer.Option(
             help="A running or finished job: set the plan against its measured step time,"
                  " tokens/s and memory (asks --server).")] = None,
         server: ServerOpt = DEFAULT_SERVER,
         top: Annotated[int, typer.Option(min=1, max=100, help="Layouts to list (auto).")] = 5,
         as_json: Annotated[bool, typer.Option("--json", help="Print the plan JSON.")] = False,
         deepspeed_config: Annotated[bool, typer.Option(
             "--deepspeed-config", help="Print the DeepSpeed config the ranks pass to"
             " deepspeed.initialize (JSON; an explicit layout, CPU ranks or GPUs as the spec"
             " says), its `deepspeed:` section merged in.")] = False,
         calibrated: Annotated[bool, typer.Option(
             "--calibrated", help="Plan with the profile `trident probe [--calibrate]`"
             " measured on --server's cluster (its rates and the trident stack's constants,"
             " marked `measured` in the plan's constants).")] = False,
         ) -> None:
    """Predict memory and step time, with no server: an explicit layout exactly as given
    (even when it does not fit), or for `parallel: auto` the best layouts; where
    TRIDENT_PRICES prices the spec's profile, what its steps would cost. With --compare
    JOB, a what-if: the plan next to that job's plan and measurement, and the step time the
    job's measured/predicted ratio makes of it.

    Example: trident plan examples/tiny.yaml --set parallel.tp=2 --set parallel.dp=1 --compare 12
    """
    from service.planner import plan_command

    if compare is not None:
        what_if(server, compare, spec, sets or [], as_json)
        return
    if spec is None:
        fail("give a SPEC (or --compare JOB to start from that job's spec)")
    if deepspeed_config:
        from service.contract.ds_config import deepspeed_config as ds_config
        job = load_spec(spec, sets)
        if isinstance(job.parallel, str):
            fail("--deepspeed-config needs an explicit layout (parallel: auto chooses one when"
                 " the job is planned)")
        typer.echo(json.dumps(ds_config(job, cuda=job.resources.gpus_per_worker > 0),
                              indent=2, sort_keys=True))
        return
    job = load_spec(spec, sets)
    profile = cluster_profile(server, job.target.gpu) if calibrated else None
    try:
        out = plan_command(job, top=top, as_json=as_json, price=local_price(job.target.gpu),
                           profile=profile)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(json.dumps(out, indent=2) if as_json else out)


def cluster_profile(server: str, name: str) -> HardwareProfile | None:
    """The profile `name` as the server's cluster calibrated it (None, said on stderr, when
    no probe has: the plan then uses the built-in one and marks its constants assumed)."""
    from cli.common import connect

    with connect(server) as client:
        stored = client.get_cluster().profiles.get(name)
    if stored is None:
        typer.echo(f"no calibrated {name!r} profile on {server}; planning with the built-in"
                   f" one (`trident probe --profile {name} --calibrate` measures it)", err=True)
        return None
    known = {f.name for f in fields(HardwareProfile)}
    return HardwareProfile.from_json({k: v for k, v in stored.model_dump().items()
                                      if k in known})


def capacity(spec: Annotated[Path | None, typer.Argument(
                 help="Answer for this spec's model and cluster.")] = None,
             family: Annotated[str | None, typer.Option(
                 help="Instead: the largest model of a family (gpt3, llama2, llama3).")] = None,
             gpu: Annotated[str, typer.Option(help="Profile, with --family.")] = "a100-80gb",
             nodes: Annotated[int, typer.Option(min=1, max=4096)] = 1,
             gpus_per_node: Annotated[int, typer.Option(min=1, max=64)] = 8,
             as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Can this cluster train this model, and with which strategy? Or: the largest model
    of a family each strategy (TP, PP, ZeRO 1-3, with and without offload) can train.

    Example: trident capacity --family llama2 --gpu a100-80gb --nodes 4
    """
    from service.planner.capacity import can_train
    from service.planner.capacity import capacity as family_capacity
    from service.planner.report import render_can_train, render_capacity

    try:
        if family is not None:
            rows = family_capacity(family, gpu=gpu, nodes=nodes, gpus_per_node=gpus_per_node)
            cluster_name = f"{nodes * gpus_per_node} x {gpu}"
            if as_json:
                typer.echo(json.dumps([{"strategy": r.strategy, "largest": r.largest,
                                        "params": r.params} for r in rows], indent=2))
            else:
                typer.echo(render_capacity(rows, family=family, cluster=cluster_name))
            return
        if spec is None:
            fail("give a SPEC or --family")
        ans = can_train(load_spec(spec))
    except ValueError as exc:
        fail(str(exc))
    typer.echo(json.dumps(ans.to_json(), indent=2) if as_json else render_can_train(ans))


def validate(spec: Path, sets: SetOpt = None) -> None:
    """Check a spec file without a server; prints it with every default filled in.

    Example: trident validate examples/tiny.yaml --set train.steps=100
    """
    typer.echo(json.dumps(load_spec(spec, sets).model_dump(mode="json"), indent=2))


def register_offline(app: typer.Typer) -> None:
    """Add these commands to the `trident` app."""
    app.command()(plan)
    app.command()(capacity)
    app.command("validate")(validate)
