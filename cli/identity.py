"""The identity commands of `trident`: log in, who am I, users, tokens, projects. Every one
talks to the REST API through `client.TridentClient`, as the caller's token allows."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.common import DEFAULT_SERVER, ServerOpt, connect, fail
from client.rest import BadServerURL, TridentClient, model_json
from client.token import save_profile

user_app = typer.Typer(no_args_is_help=True, help="Users and their roles (admins).")
token_app = typer.Typer(no_args_is_help=True, help="API tokens: yours, or (admins) anyone's.")
project_app = typer.Typer(no_args_is_help=True, help="Projects, their quotas and budgets.")


def _quota(q: float | None) -> str:
    return "-" if q is None else f"{q:g}"


def login(server: ServerOpt = DEFAULT_SERVER,
          token: Annotated[str | None, typer.Option(
              help="The API token (default: asked for, not echoed).")] = None) -> None:
    """Check a token against the server and remember it for that server (owner-only file).

    Example: trident login --server https://trident.example.com
    """
    secret = (token or typer.prompt("API token", hide_input=True)).strip()
    try:
        client = TridentClient(server, token=secret)
    except BadServerURL as exc:
        fail(f"--server: {exc}")
    with client:
        me = client.whoami()
    path = save_profile(server, secret, me.user)
    typer.echo(f"logged in to {server} as {me.user} ({me.role}); saved in {path}")


def whoami(server: ServerOpt = DEFAULT_SERVER) -> None:
    """Your user, role, projects (the default first) and the token in use.

    Example: trident whoami
    """
    with connect(server) as client:
        me = client.whoami()
    typer.echo(f"{me.user} ({me.role}); projects: {', '.join(me.projects) or '-'};"
               f" token {me.token.name!r} (id {me.token.id})")


@user_app.command("add")
def user_add(name: str, server: ServerOpt = DEFAULT_SERVER,
             role: Annotated[str, typer.Option(help="admin, member or viewer.")] = "member",
             project: Annotated[list[str] | None, typer.Option(
                 help="A project it belongs to (repeat; the first is its default).")] = None
             ) -> None:
    """Create a user; give it a token with `trident token create NAME --user USER`.

    Example: trident user add alice --role member --project vision
    """
    with connect(server) as client:
        u = client.create_user(name, role=role, projects=project)
    typer.echo(f"user {u.name} ({u.role}); projects: {', '.join(u.projects) or '-'}")


@user_app.command("list")
def user_list(server: ServerOpt = DEFAULT_SERVER) -> None:
    """Every user, with role, projects and whether it is disabled.

    Example: trident user list
    """
    with connect(server) as client:
        users = client.list_users().items
    typer.echo(f"{'NAME':<16}  {'ROLE':<7}  {'STATE':<8}  PROJECTS")
    for u in users:
        typer.echo(f"{u.name:<16}  {u.role:<7}  "
                   f"{'disabled' if u.disabled else 'active':<8}  {', '.join(u.projects)}")


@user_app.command("disable")
def user_disable(name: str, server: ServerOpt = DEFAULT_SERVER) -> None:
    """Disable a user: every token of theirs is refused from the next request on.

    Example: trident user disable alice
    """
    with connect(server) as client:
        client.disable_user(name)
    typer.echo(f"user {name} disabled")


@token_app.command("create")
def token_create(name: str, server: ServerOpt = DEFAULT_SERVER,
                 user: Annotated[str | None, typer.Option(
                     help="Whose token (admins; default: yours).")] = None,
                 expires_days: Annotated[float | None, typer.Option(
                     min=0.001, max=3650, help="Days until it expires (default: never).")]
                 = None) -> None:
    """Create a token; its secret is printed once (only its hash is stored).

    Example: trident token create laptop --expires-days 30
    """
    with connect(server) as client:
        t = client.create_token(name, user=user, expires_in_days=expires_days)
    info = t.info
    typer.echo(t.token)
    expires = "never" if info.expires_at is None else model_json(info.expires_at)
    typer.echo(f"token {info.id} {info.name!r} of {info.user}, expires {expires}; shown"
               " once: keep it now", err=True)


@token_app.command("list")
def token_list(server: ServerOpt = DEFAULT_SERVER,
               user: Annotated[str | None, typer.Option(help="Only this user's.")] = None
               ) -> None:
    """Tokens (never their secrets): yours, or, for an admin, everyone's.

    Example: trident token list --user alice
    """
    with connect(server) as client:
        tokens = client.list_tokens(user=user or None).items
    typer.echo(f"{'ID':>5}  {'USER':<16}  {'NAME':<20}  {'EXPIRES':<20}  STATE")
    for t in tokens:
        state = "revoked" if t.revoked_at else "active"
        expires = "never" if t.expires_at is None else model_json(t.expires_at)[:19]
        typer.echo(f"{t.id:>5}  {t.user:<16}  {t.name:<20}  {expires:<20}  {state}")


@token_app.command("revoke")
def token_revoke(token_id: int, server: ServerOpt = DEFAULT_SERVER) -> None:
    """Revoke a token: the next request with it is refused.

    Example: trident token revoke 7
    """
    with connect(server) as client:
        t = client.revoke_token(token_id)
    typer.echo(f"token {t.id} {t.name!r} of {t.user} revoked")


@project_app.command("add")
def project_add(name: str, server: ServerOpt = DEFAULT_SERVER,
                gpus: Annotated[float | None, typer.Option(
                    min=0, help="GPUs its running jobs may hold together.")] = None,
                cpus: Annotated[float | None, typer.Option(
                    min=0, help="CPUs its running CPU-only jobs may hold together.")] = None,
                member: Annotated[list[str] | None, typer.Option(
                    help="A user to add to it (repeat).")] = None) -> None:
    """Create a project (admins), with a quota and members.

    Example: trident project add vision --gpus 24 --member alice
    """
    with connect(server) as client:
        p = client.create_project(name, gpus=gpus, cpus=cpus, members=member)
    typer.echo(f"project {p.name}: quota {_quota(p.gpu_quota)} GPUs,"
               f" {_quota(p.cpu_quota)} CPUs; members: {', '.join(p.members) or '-'}")


@project_app.command("quota")
def project_quota(name: str, server: ServerOpt = DEFAULT_SERVER,
                  gpus: Annotated[float | None, typer.Option(
                      min=0, help="GPUs (none: no limit).")] = None,
                  cpus: Annotated[float | None, typer.Option(
                      min=0, help="CPUs of CPU-only jobs (none: no limit).")] = None,
                  max_priority: Annotated[int | None, typer.Option(
                      min=-1000, max=1000, help="The highest priority its members may give"
                      " a job (none: no cap).")] = None) -> None:
    """Set a project's quota and priority cap (admins): a limit not given is lifted. The
    scheduler applies the quota from its next pass; the cap applies to new submissions.

    Example: trident project quota vision --gpus 32 --max-priority 10
    """
    with connect(server) as client:
        p = client.set_quota(name, gpus=gpus, cpus=cpus, max_priority=max_priority)
    typer.echo(f"project {p.name}: quota {_quota(p.gpu_quota)} GPUs,"
               f" {_quota(p.cpu_quota)} CPUs, max priority {_quota(p.max_priority)}")


@project_app.command("budget")
def project_budget(name: str, server: ServerOpt = DEFAULT_SERVER,
                   gpu_hours: Annotated[float | None, typer.Option(
                       min=0, max=1e9, help="GPU-hours its jobs may spend.")] = None,
                   cpu_hours: Annotated[float | None, typer.Option(
                       min=0, max=1e9, help="CPU-hours its ranks without a GPU may spend.")]
                   = None,
                   cost: Annotated[float | None, typer.Option(
                       min=0, max=1e9, help="Money its jobs may spend, at the server's"
                       " prices (TRIDENT_PRICES).")] = None,
                   since: Annotated[datetime | None, typer.Option(
                       help="Count from this time (default: now; UTC when no zone).")] = None,
                   stop_running: Annotated[bool, typer.Option(
                       "--stop-running", help="Cancel its running jobs once a budget is"
                       " spent (default: they finish; new jobs are refused).")] = False,
                   remove: Annotated[bool, typer.Option(
                       "--remove", help="Remove its budget.")] = False) -> None:
    """Set a project's budget (admins): its jobs are warned at 80 % of it and new ones refused
    at 100 %. Setting it again starts the count again (from now, or --since).

    Example: trident project budget vision --gpu-hours 5000 --since 2026-12-01
    """
    with connect(server) as client:
        if remove:
            p = client.remove_budget(name)
        else:
            p = client.set_budget(name, gpu_hours=gpu_hours, cpu_hours=cpu_hours, cost=cost,
                                  since=since, stop_running=stop_running)
    typer.echo(f"project {p.name}: {_budget(p)}")


def _budget(p: Any) -> str:
    if p.budget_since is None:
        return "no budget"
    return (f"budget {_quota(p.budget_gpu_hours)} GPU-hours, {_quota(p.budget_cpu_hours)}"
            f" CPU-hours, {_quota(p.budget_cost)} in cost since {model_json(p.budget_since)}"
            + ("; running jobs stopped when spent" if p.budget_stop_running else ""))


@project_app.command("list")
def project_list(server: ServerOpt = DEFAULT_SERVER) -> None:
    """Projects, their quotas and members.

    Example: trident project list
    """
    with connect(server) as client:
        projects = client.list_projects().items
    for p in projects:
        typer.echo(f"{p.name:<16}  GPUs {_quota(p.gpu_quota):>6}  CPUs"
                   f" {_quota(p.cpu_quota):>6}  {', '.join(p.members)}")


def open_database(settings: Any) -> None:
    """Open the database as `trident up` starts (`service.store.opening`): its lines on
    stdout; one line and exit status 1 when it cannot be read."""
    from service.store.dbcheck import Unreadable
    from service.store.opening import open_database as open_db

    try:
        open_db(settings.db_url, settings.data_dir, first_admin=settings.env != "prod",
                say=typer.echo)
    except Unreadable as exc:
        fail(str(exc), 1)


def bootstrap_admin(data_dir: Annotated[Path | None, typer.Option(
        envvar="TRIDENT_DATA_DIR", help="Where the token file goes.")] = None) -> None:
    """Create the first admin user and its token file (`trident up` does it by itself,
    except with TRIDENT_ENV=prod). Talks to the database, not the API.

    Example: TRIDENT_ENV=prod trident bootstrap --data-dir /var/lib/trident
    """
    from service.settings import Settings
    from service.store import Store
    from service.store.bootstrap import bootstrap
    from service.store.identity import Identity
    from service.store.schema import upgrade

    settings = Settings(data_dir=data_dir) if data_dir else Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.db_url)
    store = Store(settings.db_url)
    try:
        path = bootstrap(Identity(store), settings.data_dir)
    finally:
        store.close()
    if path is None:
        fail("users exist already: nothing was created (an admin adds users with"
             " `trident user add`)", 1)
    typer.echo(f"created the admin user; its API token is in {path} (readable by you only)")


def register(app: typer.Typer) -> None:
    """Add these commands to the `trident` app."""
    app.command("bootstrap")(bootstrap_admin)
    app.command()(login)
    app.command()(whoami)
    app.add_typer(user_app, name="user")
    app.add_typer(token_app, name="token")
    app.add_typer(project_app, name="project")
