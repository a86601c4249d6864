"""API tokens for the benchmarks: every route but healthz needs one."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any


def admin_headers(store: Any) -> dict[str, str]:
    """An admin's Authorization header for an app on `store` (user `bench-admin`)."""
    from service.store.identity import Conflict, Identity

    identity = Identity(store)
    with contextlib.suppress(Conflict):  # made by an earlier call
        identity.create_project(name="default")
    with contextlib.suppress(Conflict):
        identity.create_user(name="bench-admin", role="admin", projects=["default"])
    token, _ = identity.create_token(user="bench-admin", name="bench")
    return {"Authorization": f"Bearer {token}"}


def token_file_headers(data_dir: Path, timeout_s: float = 60) -> dict[str, str]:
    """The bootstrap admin's header of a server that owns `data_dir` (`trident up`, or the
    app with its own store), once it has written `admin.token`."""
    path = data_dir / "admin.token"
    end = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"no {path} after {timeout_s:g} s")
        time.sleep(0.2)
    return {"Authorization": f"Bearer {path.read_text().strip()}"}
