"""Exports run beside a test's API (`running_exports`): the controller's `ExportRunner`
stepped on a thread of the test's, each export run by `run` (default the converter as a
process of its own, `service.files.export.run_in_process`; the system tier passes the Ray
task, `workers.launch.export_task.ray_export`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from service.control.export_run import ExportRunner
from service.files.export import ExportDone, ExportWork, run_in_process
from service.store import Store


@contextlib.contextmanager
def running_exports(store: Store, run: Callable[[ExportWork], ExportDone] = run_in_process,
                    every_s: float = 0.1) -> Iterator[ExportRunner]:
    runner = ExportRunner(store, run, limit=2)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            runner.step()
            stop.wait(every_s)

    thread = threading.Thread(target=loop, name="test-exports", daemon=True)
    thread.start()
    try:
        yield runner
    finally:
        stop.set()
        thread.join()
        runner.drain(60)
        runner.shutdown()
