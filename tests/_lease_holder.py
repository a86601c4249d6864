"""A stand-in controller for the supervision tests: holds the controller's lease (no Ray), as
the daemon does, until SIGTERM; then releases it. Usage: python tests/_lease_holder.py URL
LEASE_S."""

from __future__ import annotations

import signal
import sys
import threading

from service.store import Store
from service.store.lease import Leader, Role


def main() -> None:
    url, lease_s = sys.argv[1], float(sys.argv[2])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    store = Store(url)
    leader = Leader(store, duration_s=lease_s)
    print(f"holder {leader.holder}", flush=True)
    while not stop.is_set():
        if leader.acquire_or_renew() == Role.LOST:
            sys.exit(3)
        stop.wait(lease_s / 5)
    leader.release()
    print(f"holder {leader.holder} stopped", flush=True)


if __name__ == "__main__":
    main()
