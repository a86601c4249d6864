"""Where a client finds its API token, in order: `TRIDENT_TOKEN`; the profile `trident login`
saved for the server; for a server on this machine, the bootstrap admin's token file that
`trident up` wrote into the data directory (`TRIDENT_DATA_DIR`, default `./var`). So the
local demo needs no step of its own, and a remote server needs one `trident login`.

The token file's name is part of the contract between the server, which writes it on a first
start (`service.store.bootstrap`), and its clients on the same machine, which read it: it is
named here, where both import it. `client.TridentClient` calls `token_for`; `trident login`
calls `save_profile`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
TOKEN_FILE = "admin.token"
"""The bootstrap admin's token, in the data directory, readable by its owner only."""


def token_file(data_dir: Path) -> Path:
    return data_dir / TOKEN_FILE


def profiles_path() -> Path:
    """`TRIDENT_CONFIG_DIR` (default `$XDG_CONFIG_HOME/trident` or `~/.config/trident`)
    holds `profiles.json`, readable by its owner only."""
    base = os.environ.get("TRIDENT_CONFIG_DIR") or os.path.join(
        os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config"), "trident")
    return Path(base) / "profiles.json"


def _key(server: str) -> str:
    return server.rstrip("/")


def load_profiles() -> dict[str, Any]:
    try:
        data = json.loads(profiles_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_profile(server: str, token: str, user: str) -> Path:
    """Remember `token` for `server` (the file is created owner-only)."""
    path = profiles_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    profiles = load_profiles()
    profiles[_key(server)] = {"token": token, "user": user}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(profiles, f, indent=2)
    os.chmod(path, 0o600)
    return path


def local_token_file() -> Path:
    return token_file(Path(os.environ.get("TRIDENT_DATA_DIR") or Path.cwd() / "var"))


def token_for(server: str) -> tuple[str | None, str]:
    """The token to send to `server`, and where it came from (for error messages)."""
    if token := os.environ.get("TRIDENT_TOKEN", "").strip():
        return token, "TRIDENT_TOKEN"
    profile = load_profiles().get(_key(server))
    if isinstance(profile, dict) and isinstance(profile.get("token"), str):
        return profile["token"], f"the `trident login` profile in {profiles_path()}"
    if urlsplit(server).hostname in LOCAL_HOSTS:
        path = local_token_file()
        try:
            return path.read_text().strip(), f"the bootstrap token file {path}"
        except OSError:
            pass
    return None, "nowhere"
