"""The `trident` commands that need no server: `plan`, `capacity`, `validate`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from service.spec import JobSpec


def _load_spec(path: Path) -> JobSpec:
    from api.cli import load_spec  # late: api.cli registers these commands

    return load_spec(path)


def _fail(message: str, code: int = 2) -> NoReturn:
    from api.cli import fail

    fail(message, code)


def plan(spec: Path,
         top: Annotated[int, typer.Option(min=1, max=100, help="Layouts to list (auto).")] = 5,
         as_json: Annotated[bool, typer.Option("--json", help="Print the plan JSON.")] = False,
         ) -> None:
    """Predict memory and step time, with no server: an explicit layout exactly as given
    (even when it does not fit), or for `parallel: auto` the best layouts."""
    from service.planner import plan_command

    try:
        out = plan_command(_load_spec(spec), top=top, as_json=as_json)
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(out, indent=2) if as_json else out)


def capacity(spec: Annotated[Path | None, typer.Argument(
                 help="Answer for this spec's model and cluster.")] = None,
             family: Annotated[str | None, typer.Option(
                 help="Instead: the largest model of a family (gpt3, llama2, llama3).")] = None,
             gpu: Annotated[str, typer.Option(help="Profile, with --family.")] = "a100-80gb",
             nodes: Annotated[int, typer.Option(min=1, max=4096)] = 1,
             gpus_per_node: Annotated[int, typer.Option(min=1, max=64)] = 8,
             as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Can this cluster train this model, and with which strategy? Or: the largest model
    of a family each strategy (TP, PP, ZeRO 1-3, with and without offload) can train."""
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
            _fail("give a SPEC or --family")
        ans = can_train(_load_spec(spec))
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(ans.to_json(), indent=2) if as_json else render_can_train(ans))


def validate(spec: Path) -> None:
    """Check a spec file without a server; prints it with every default filled in."""
    typer.echo(json.dumps(_load_spec(spec).model_dump(mode="json"), indent=2))


def register_offline(app: typer.Typer) -> None:
    """Add these commands to the `trident` app."""
    app.command()(plan)
    app.command()(capacity)
    app.command("validate")(validate)
