"""Start-up's objects are frozen out of garbage collection in the long-running processes."""

import gc

import pytest

from service.control.heap import freeze_startup_objects


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process goes on collecting everything


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: tracked by the collector


def test_freeze_moves_live_objects_out_of_every_generation(unfrozen):
    before = _Node()
    assert any(o is before for g in range(3) for o in gc.get_objects(generation=g))
    frozen = freeze_startup_objects()
    # A frozen object still dies when its last reference goes (another thread of the test
    # process may drop a few meanwhile): the count may only have shrunk, and barely.
    assert frozen > 1000 and 0 <= frozen - gc.get_freeze_count() < 100
    assert not any(o is before for g in range(3) for o in gc.get_objects(generation=g))
    after = _Node()  # what requests create later is collected as before
    assert any(o is after for o in gc.get_objects(generation=0))


def test_the_uvicorn_factory_freezes_the_app_it_builds(unfrozen, tmp_path, monkeypatch):
    from api.app import app

    monkeypatch.setenv("TRIDENT_DATA_DIR", str(tmp_path))
    assert gc.get_freeze_count() == 0
    made = app()
    assert gc.get_freeze_count() > 1000
    assert not any(o is made for g in range(3) for o in gc.get_objects(generation=g))


def test_the_controller_daemon_freezes_once_it_leads(unfrozen, tmp_path, monkeypatch):
    import threading

    import service.control.daemon as daemon
    from service.settings import Settings
    from tests.fakes import FakeLauncher
    from tests.waiting import wait_for

    monkeypatch.setattr(daemon, "connect_ray", lambda _settings: FakeLauncher([]))
    stop = threading.Event()
    status: list[int] = []
    t = threading.Thread(target=lambda: status.append(daemon.run(
        Settings(data_dir=tmp_path, poll_interval_s=0.05), stop)))
    t.start()
    try:
        wait_for("the daemon's first pass", lambda: bool(gc.get_freeze_count())
                 or not t.is_alive())
        assert gc.get_freeze_count() > 1000
    finally:
        stop.set()
        t.join(30)
    assert status == [0]
