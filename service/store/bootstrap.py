"""The first admin of a fresh database and its token file (`DATA_DIR/admin.token`), and
what keeps a production server from starting without one."""

from __future__ import annotations

import os
import stat
from contextlib import suppress
from pathlib import Path

from client.token import token_file
from service.store.identity import (
    BOOTSTRAP_USER,
    DEFAULT_PROJECT,
    Conflict,
    Identity,
)


def bootstrap(identity: Identity, data_dir: Path) -> Path | None:
    """On a first start (no user at all): create the `admin` user, the `default` project and
    a token, written to `DATA_DIR/admin.token` readable by its owner only. Returns the file's
    path when it was written now, else None (users exist already)."""
    if identity.list_users():
        return None
    with suppress(Conflict):
        identity.create_project(name=DEFAULT_PROJECT)
    try:
        identity.create_user(name=BOOTSTRAP_USER, role="admin", projects=[DEFAULT_PROJECT])
    except Conflict:  # another process bootstraps at the same time
        return None
    secret, _ = identity.create_token(user=BOOTSTRAP_USER, name="bootstrap")
    path = token_file(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    return path


def prod_refusal(identity: Identity, data_dir: Path) -> str | None:
    """Why a production server must not start: no admin, or a bootstrap token file that
    others can read. None when it may."""
    if not identity.has_admin():
        return ("no admin user exists: run `trident bootstrap` once (it creates the admin and"
                f" its token file {token_file(data_dir)}) before starting in prod")
    path = token_file(data_dir)
    if path.exists() and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (f"the bootstrap token file {path} is readable by others"
                f" (mode {stat.filemode(path.stat().st_mode)}): chmod 600 it")
    return None
