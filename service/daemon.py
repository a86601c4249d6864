"""The controller daemon, and the composition root: the one place where `service/` meets
`workers/`, by a lazy import, so that the control plane's modules never load Ray or torch.

Run by `trident up` as its own process, or alone: `python -m service.daemon`.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
from types import FrameType

from service.controller import Controller
from service.settings import Settings
from service.store import Store

log = logging.getLogger("trident.controller")


def connect_ray(settings: Settings) -> object:
    """Connect to the configured Ray cluster, or start a local one; returns the launcher."""
    ray = importlib.import_module("ray")
    if settings.ray_address:
        ray.init(address=settings.ray_address, log_to_driver=True)
    else:
        ray.init(include_dashboard=False, log_to_driver=True)
    return importlib.import_module("workers.group").RayLauncher()


def run(settings: Settings, stop: threading.Event) -> None:
    store = Store(settings.db_url)
    store.migrate()
    controller = Controller(store, connect_ray(settings),  # type: ignore[arg-type]
                            checkpoint_root=settings.checkpoint_root,
                            start_timeout_s=settings.start_timeout_s,
                            cancel_grace_s=settings.cancel_grace_s)
    log.info("controller running against %s", settings.db_url)
    parent = int(os.environ.get("TRIDENT_PARENT_PID", "0"))
    try:
        while not stop.is_set():
            if parent and os.getppid() != parent:  # `trident up` is gone: so are we
                log.info("parent process %s ended: stopping", parent)
                break
            try:
                result = controller.step()
            except Exception:  # one bad pass must not end the daemon
                log.exception("controller step failed")
                stop.wait(settings.poll_interval_s * 4)
                continue
            for change in result.changes:
                log.info("job %s -> %s: %s", change.job_id, change.to, change.message)
            stop.wait(settings.poll_interval_s)
    finally:
        controller.shutdown()
        store.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %s: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    run(settings, stop)


if __name__ == "__main__":
    main()
