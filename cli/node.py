"""`trident node start|stop` (this host's Ray node, the way Trident needs it), `trident node
cordon|drain|uncordon HOST` (keep new ranks off a node, move its jobs; admins, through the REST
API) and `trident cluster` (the nodes, their states and the jobs on them, from the REST API).

`node start|stop` do not talk to the API: they start `ray start` on this host
(`service.cluster.raynode`) with the node's GPU model, memory, profile and link matrix as Ray
labels (`service.cluster.node_labels`), which the controller's inventory reads back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

import typer

from cli.common import DEFAULT_SERVER, ServerOpt, connect, fail
from client.payloads import Node, NodeInfo, NodeJob
from client.rest import model_json

DataDirOpt = Annotated[Path | None, typer.Option(
    envvar="TRIDENT_DATA_DIR", help="Where the node's state, log and (head) Ray token live;"
    " default ./var.")]

node_app = typer.Typer(no_args_is_help=True,
                       help="This host's Ray node: start it (head or worker) or stop it;"
                       " cordon, drain or uncordon a node of the cluster.")
HostArg = Annotated[str, typer.Argument(
    help="The node: its id (or a unique prefix), hostname or address, as `trident cluster`"
    " shows them.", show_default=False)]
ReasonOpt = Annotated[str, typer.Option(help="Why, for the others (at most 500 characters).")]


def _data_dir(data_dir: Path | None) -> Path:
    from service.settings import default_data_dir

    return (data_dir or default_data_dir()).resolve()


@node_app.command("start")
def node_start(
        head: Annotated[bool, typer.Option("--head", help="Start the cluster's head.")] = False,
        address: Annotated[str | None, typer.Option(
            help="The head to join (HOST:PORT); without --head.")] = None,
        port: Annotated[int, typer.Option(min=1, max=65535, help="The head's port.")] = 6379,
        num_cpus: Annotated[int | None, typer.Option(
            min=0, max=4096, help="CPUs Ray may schedule here (default: all cores).")] = None,
        num_gpus: Annotated[int | None, typer.Option(
            min=0, max=64, help="GPUs Ray may schedule here (default: those detected).")]
        = None,
        gpu_profile: Annotated[str | None, typer.Option(
            help="The hardware profile to declare (default: the GPU's, else cpu).")] = None,
        node_ip_address: Annotated[str | None, typer.Option(
            help="This node's address as the others reach it.")] = None,
        temp_dir: Annotated[Path | None, typer.Option(
            help="Ray's temp dir for this node (short: it holds sockets).")] = None,
        auth_token_file: Annotated[Path | None, typer.Option(
            envvar="RAY_AUTH_TOKEN_PATH", help="Ray's auth token (head: made under the data"
            " dir unless given; worker: the head's).")] = None,
        data_dir: DataDirOpt = None,
        timeout: Annotated[float, typer.Option(min=1, max=600, help="Seconds to wait.")] = 120,
        dry_run: Annotated[bool, typer.Option(
            "--dry-run", help="Print the labels and the `ray start` command; start nothing.")]
        = False) -> None:
    """Start this host's Ray node with its GPU model, memory, profile and NVLink/PCIe matrix
    as labels, and its CPUs and GPUs; returns once it runs (it keeps running). It listens on
    every interface, for the other hosts (unlike `trident up`'s own head, on loopback only).

    Example: trident node start --head --port 6379; on the other hosts:
    trident node start --address HEAD:6379 --auth-token-file TOKEN
    """
    from service.cluster.inventory import node_inventory
    from service.cluster.node_labels import node_labels
    from service.cluster.rayhead import HEALTH_CHECK_ENV, auth_env
    from service.cluster.raynode import (
                START_WAIT_ENV,
        host_ip,
        ray_start_argv,
        start_node,
    )
    from service.contract.hardware import PROFILES
    from service.secrets import without_server_secrets

    if head == bool(address):
        fail("give either --head or --address HEAD:PORT")
    if gpu_profile is not None and gpu_profile not in PROFILES:
        fail(f"--gpu-profile: unknown hardware profile {gpu_profile!r}; known:"
             f" {sorted(PROFILES)}")
    root = _data_dir(data_dir)
    inv = node_inventory()
    labels = node_labels(inv, gpu_profile)
    where = address or f"{node_ip_address or host_ip()}:{port}"
    argv = ray_start_argv(head=head, address=where, labels=labels, node_ip=node_ip_address,
                          num_cpus=(os.cpu_count() or 1) if num_cpus is None else num_cpus,
                          num_gpus=len(inv["gpus"]) if num_gpus is None else num_gpus,
                          temp_dir=str(temp_dir) if temp_dir else None)
    if dry_run:
        typer.echo(json.dumps({"labels": labels, "argv": argv}, indent=2))
        return
    token = auth_token_file or (root / "ray" / "auth_token" if head else None)
    if token is not None and not head and not token.exists():
        fail(f"--auth-token-file: {token} does not exist (copy the head's token here)")
    auth = auth_env(token) if token is not None else {}
    try:
        state = start_node(root, role="head" if head else "worker", address=where, argv=argv,
                           env={**START_WAIT_ENV, **(HEALTH_CHECK_ENV if head else {}),
                                **without_server_secrets(os.environ), **auth},
                           temp_dir=str(temp_dir) if temp_dir else None, timeout_s=timeout)
    except RuntimeError as exc:
        fail(str(exc), 1)
    typer.echo(f"ray {state.role} node running (pid {state.pid}, log {state.log}),"
               f" cluster at {state.address}")
    typer.echo("listening on every interface of this host (Ray's ports: the head's, and those"
               " of its servers and workers), for the other hosts: keep them behind a firewall"
               " that lets only the cluster's hosts in")
    typer.echo("labels: " + ", ".join(f"{k}={v}" for k, v in labels.items()))
    if head and token is not None:
        typer.echo(f"join: trident node start --address {where} --auth-token-file {token}")
        typer.echo(f"control plane: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token}"
                   f" trident up --ray-address {where}")


@node_app.command("stop")
def node_stop(data_dir: DataDirOpt = None,
              grace: Annotated[float, typer.Option(min=0, max=600, help="Seconds before the"
                                                   " node's processes are killed.")] = 30
              ) -> None:
    """Stop the Ray node `trident node start` started from this data dir, and nothing else
    (never `ray stop`, which stops every node of the host).

    Example: trident node stop --data-dir /srv/trident
    """
    from service.cluster.raynode import stop_node

    root = _data_dir(data_dir)
    state = stop_node(root, grace)
    if state is None:
        fail(f"no node started from {root} is running", 1)
    typer.echo(f"ray {state.role} node stopped (pid {state.pid})")


def _named(node: Node) -> str:
    address = node.info.get("address")
    return f"node {node.node_id[:12]} ({node.hostname}{', ' + address if address else ''})"


@node_app.command("cordon")
def node_cordon(host: HostArg, reason: ReasonOpt = "",
                server: ServerOpt = DEFAULT_SERVER) -> None:
    """Place no new rank on a node; the jobs there run on. Admins only.

    Example: trident node cordon gpu-07 --reason "fan noise, check Tuesday"
    """
    with connect(server) as client:
        node = client.cordon_node(host, reason=reason)
    assert node.cordon is not None
    typer.echo(f"{_named(node)} {node.state} by {node.cordon.by}: {node.cordon.reason}")


@node_app.command("drain")
def node_drain(host: HostArg,
               grace: Annotated[float, typer.Option(
                   min=0, max=86400, help="Seconds the jobs there get to save a checkpoint"
                   " and stop before they are stopped.")] = 300,
               reason: ReasonOpt = "", server: ServerOpt = DEFAULT_SERVER) -> None:
    """Cordon a node, then move every job with ranks there: each saves a checkpoint at its
    next step boundary, stops, and resumes from it on the other nodes (no retry spent). Admins
    only; `trident cluster` shows the node drained once no job's ranks are left there.

    Example: trident node drain gpu-07 --grace 600 --reason "BIOS update"
    """
    with connect(server) as client:
        node = client.drain_node(host, grace_s=grace, reason=reason)
        jobs = client.get_cluster().jobs.get(node.node_id) or []
    moving = (f"jobs {', '.join(str(j.job_id) for j in jobs)} save a checkpoint and move"
              f" within {grace:g} s" if jobs else "no job has ranks there")
    typer.echo(f"{_named(node)} draining: {moving}")


@node_app.command("uncordon")
def node_uncordon(host: HostArg, server: ServerOpt = DEFAULT_SERVER) -> None:
    """Let new ranks be placed on a node again. Admins only.

    Example: trident node uncordon gpu-07
    """
    with connect(server) as client:
        node = client.uncordon_node(host)
    typer.echo(f"{_named(node)} {node.state}: new ranks may be placed there")


def _jobs_cell(jobs: list[NodeJob]) -> str:
    from cli.stacks import rank_ranges

    return " ".join(f"{j.job_id}[r{rank_ranges(j.ranks)}]" for j in jobs) or "-"


def cluster(server: ServerOpt = DEFAULT_SERVER,
            output: Annotated[Literal["table", "json"], typer.Option(
                "--output", "-o", help="table, or the API's JSON.")] = "table") -> None:
    """The cluster's nodes as the controller last saw them, with the jobs on each (job id
    and its ranks there), each cordon and slow link, and the calibrated profiles.

    Example: trident cluster -o json
    """
    with connect(server) as client:
        c = client.get_cluster()
    if output == "json":
        typer.echo(json.dumps(model_json(c), indent=2))
        return
    typer.echo(f"{'NODE':<12}  {'HOST':<20} {'STATE':<8}  {'CPU':>5} {'GPU':>4}"
               f"  {'HARDWARE':<38} {'LINK':<6}  JOBS")
    for n in c.nodes:
        info = NodeInfo.of(n)
        res = info.resources
        what = (f"{len(info.gpus)} x {info.gpu_model}" if info.accelerator == "gpu"
                else f"CPU, {info.cpus} cores")
        if info.profile:
            what += f" ({info.profile})"
        typer.echo(f"{n.node_id[:12]:<12}  {n.hostname[:20]:<20}"
                   f" {_state(n):<8}  {res.get('CPU', 0):>5g}"
                   f" {res.get('GPU', 0):>4g}  {what[:38]:<38} {info.gpu_link or '-':<6}"
                   f"  {_jobs_cell(c.jobs.get(n.node_id) or [])}")
    for n in c.nodes:
        if n.cordon is not None:
            typer.echo(f"{_named(n)} {n.state} by {n.cordon.by} at"
                       f" {n.cordon.at:%Y-%m-%d %H:%M:%S}: {n.cordon.reason}")
    for n in c.nodes:
        if n.slow_link is not None:
            typer.echo(f"{_named(n)} slow link since {n.slow_link.time:%Y-%m-%d %H:%M:%S}"
                       f" ({n.slow_link.by}): {n.slow_link.message}")
    for name, p in c.profiles.items():
        cal = (p.model_extra or {}).get("calibration")
        typer.echo(f"profile {name}: calibrated by probe {p.probe_id}" + (
            f"; {cal['stack']} stack's efficiency {cal['efficiency']:.3g} measured by jobs"
            f" {', '.join(map(str, cal['jobs']))} (fit error {100 * cal['error']:.0f}%)"
            if cal else ""))


def _state(node: Node) -> str:
    """dead, alive (ready), or its cordon state."""
    return "dead" if not node.alive else "alive" if node.state == "ready" else node.state


def register(app: typer.Typer) -> None:
    """Add `trident node ...` and `trident cluster` to the `trident` app."""
    app.add_typer(node_app, name="node")
    app.command()(cluster)
