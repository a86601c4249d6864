"""What every `trident` command shares: the `--server` option, the client a command talks to
the REST API through (`connect`: an `client.TridentClient`), the one-line error with a
non-zero exit (`fail`), and the `trident` command group (`Trident`) that turns every error
into such a line: a refusal of the API (what to do about a 401 or a 403; for a 422 the
field with the arithmetic), an unreachable server (its address), a usage error (with the
`--help` to read). Never a traceback, never a box.
"""

from __future__ import annotations

import inspect
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, NoReturn, Protocol, TypeVar

import typer
from typer.core import TyperGroup

from client.payloads import StackStatus
from client.rest import (
    DEFAULT_SERVER,
    BadServerURL,
    ConnectionFailed,
    Forbidden,
    TridentClient,
    TridentError,
    Unauthorized,
)

__all__ = ["DEFAULT_SERVER", "ServerOpt", "Trident", "connect", "error_line", "fail"]

ServerOpt = Annotated[str, typer.Option("--server", envvar="TRIDENT_SERVER",
                                        help="Base URL of the Trident API.")]
REFUSED = 2
"""The exit status of a request that was refused or could not be made, and of a usage
error."""


def fail(message: str, code: int = REFUSED) -> NoReturn:
    """Print `error: message` on stderr (one line) and exit with `code`."""
    typer.echo(_line(message), err=True)
    raise typer.Exit(code)


def _line(message: str) -> str:
    """`error: message`, its line breaks and runs of spaces made single spaces."""
    return f"error: {' '.join(message.split())}"


class Asked(Protocol):
    """A stack or profile request as the API answers it."""

    @property
    def id(self) -> int: ...
    @property
    def status(self) -> StackStatus: ...


A = TypeVar("A", bound=Asked)


def answered(req: A, read: Callable[[int], A], *, noun: str, job_id: int, timeout: float,
             every_s: float) -> A:
    """`req` read again with `read(req.id)` every `every_s` seconds until the controller
    answered it (done or failed); exits 1 after `timeout` seconds without an answer."""
    deadline = time.monotonic() + timeout
    while req.status in (StackStatus.PENDING, StackStatus.RUNNING):
        if time.monotonic() > deadline:
            fail(f"{noun} {req.id} of job {job_id} still {req.status.value} after"
                 f" {timeout:g} s: is the controller running? (`trident status`)", 1)
        time.sleep(every_s)
        req = read(req.id)
    return req


def connect(server: str) -> TridentClient:
    """The client of the API at `server`, with the token the CLI finds for it."""
    try:
        return TridentClient(server)
    except BadServerURL as exc:
        fail(f"--server: {exc}")


def error_line(exc: TridentError) -> str:
    """The line for an error of the client, with what to do about it."""
    if isinstance(exc, ConnectionFailed):
        return (f"{exc} (is `trident up` running there? --server or TRIDENT_SERVER selects"
                " another)")
    if isinstance(exc, Unauthorized):
        return (f"{exc} (token from {exc.token_source}; set TRIDENT_TOKEN or run `trident"
                f" login` for {exc.server})")
    if isinstance(exc, Forbidden):
        return f"{exc} (`trident whoami` shows your role; an admin can change it)"
    if isinstance(exc, BadServerURL):
        return f"--server: {exc}"
    return str(exc)


def file_error(exc: OSError) -> str:
    """A file or folder a command cannot read, write or make (a data dir under a file, a
    config dir it may not write): its path and the system's reason."""
    path = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else f"{exc.filename}"
    return f"{path}: {exc.strerror or exc}"


class Trident(TyperGroup):
    """The `trident` command group: whatever goes wrong in a command is one line on stderr,
    `error: ...`, and a non-zero exit (Typer draws a box of several lines for a usage error,
    and an error of the client, or a file the command cannot read or write, would be a
    traceback)."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        kw = {"args": args, "prog_name": prog_name, "complete_var": complete_var,
              "windows_expand_args": windows_expand_args, **extra}
        if not standalone_mode:
            return super().main(standalone_mode=False, **kw)
        try:
            rv = super().main(standalone_mode=False, **kw)
        except TridentError as exc:
            _error(error_line(exc), REFUSED)
        except typer.TyperException as exc:  # Typer's click: a usage error and the like
            if type(exc).__name__ == "NoArgsIsHelpError":
                # `trident` (or `trident user`) alone: the help, which Typer has printed
                # already when it draws it with rich (the message is then empty).
                if exc.format_message().strip():
                    typer.echo(exc.format_message(), err=True)
                sys.exit(exc.exit_code)
            ctx = getattr(exc, "ctx", None)
            hint = f" (`{ctx.command_path} --help` shows the usage)" if ctx is not None else ""
            _error(exc.format_message().rstrip(".") + hint, exc.exit_code)
        except typer.Abort:
            _error("aborted", 1)
        except OSError as exc:
            if not exc.filename:  # no file's fault: the program's, whose traceback tells where
                raise
            _error(file_error(exc), REFUSED)
        sys.exit(rv if isinstance(rv, int) else 0)


def _error(message: str, code: int) -> NoReturn:
    typer.echo(_line(message), err=True)
    sys.exit(code)


def first_sentence(doc: str | None) -> str:
    """A command's line in `trident --help`: the first sentence of its docstring, whole."""
    paragraph = " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())
    m = re.match(r"(.+?[.?!])(?:\s+(?=[A-Z`(])|$)", paragraph)
    return m.group(1) if m else paragraph


def short_helps(app: typer.Typer) -> None:
    """Give every command of `app` (and of its groups) the first sentence of its docstring as
    its line in the group's `--help` (Typer would print the whole first paragraph with its
    docstring's line breaks, cutting sentences apart)."""
    for info in app.registered_commands:
        if info.short_help is None and info.callback is not None:
            info.short_help = first_sentence(info.help or info.callback.__doc__)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            short_helps(group.typer_instance)
