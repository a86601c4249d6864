"""`GET /api/v1/healthz`: the database and the controller's lease, reported separately, and
the data directory's filesystem (`nearly full` under `TRIDENT_DATA_DIR_MIN_FREE`).

Read from the store only (the lease row the controller renews every pass), never from Ray.
A data directory nearly full is named, but does not make the stack `degraded`: the control
plane works on (`service.files.diskfull`), and a health check that restarted it would not help.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse

from service.files.datadir import usage
from service.settings import Settings
from service.store import Store
from service.store.dbcheck import damaged
from service.store.lease import CONTROLLER, Leases
from service.store.tables import utcnow

log = logging.getLogger(__name__)


def health(store: Store, settings: Settings | None = None) -> JSONResponse:
    """200 `ok` when the database answers and a controller holds an unexpired lease; else 503
    `degraded`, with `database` or `controller` saying what is wrong. With `settings`, also
    `data_dir` (`service.files.datadir.usage`)."""
    disk = {} if settings is None else {
        "data_dir": usage(settings.data_dir, settings.data_dir_min_free)}
    try:
        lease = Leases.of(store).read(name=CONTROLLER)
    except Exception as exc:  # any failure to read is the database's
        log.warning("healthz: the database does not answer: %s", exc)
        return JSONResponse(status_code=503, content={
            "status": "degraded",
            "database": f"{'damaged' if damaged(exc) else 'unavailable'}: {type(exc).__name__}",
            "controller": None, **disk})
    now = utcnow()
    controller: dict[str, Any] = {"holder": None, "lease_age_s": None, "expires_in_s": None}
    if lease is not None:
        controller = {"holder": lease.holder,
                      "lease_age_s": round((now - lease.renewed_at).total_seconds(), 3),
                      "expires_in_s": round((lease.expires_at - now).total_seconds(), 3)}
    ok = lease is not None and lease.held(now)
    if not ok:
        controller["error"] = ("no controller has held the lease" if lease is None else
                               "the controller has not renewed its lease in time")
    return JSONResponse(status_code=200 if ok else 503, content={
        "status": "ok" if ok else "degraded", "database": "ok", "controller": controller,
        **disk})
