"""Node inventories beside the controller's loop: a slow node holds no pass."""

from __future__ import annotations

import threading
from typing import Any

from service.cluster.data_plane import NodeCapacity
from service.control.node_survey import NodeSurvey
from service.store import Store
from tests.waiting import wait_for


class SlowInventory:
    """Answers at once the first time; later answers wait until `release` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()
        self.started = threading.Event()

    def inventory(self) -> list[dict[str, Any]]:
        self.calls += 1
        if self.calls > 1:
            self.started.set()
            assert self.release.wait(30), "never released"
        return [{"node_id": f"n{i}", "hostname": f"h{i}"} for i in range(self.calls)]


def test_the_first_inventory_is_taken_in_the_pass_and_later_ones_beside_it(
        sqlite_store: Store) -> None:
    launcher = SlowInventory()
    survey = NodeSurvey(sqlite_store, launcher, every_s=0.0)  # type: ignore[arg-type]
    survey.step()  # the first: in the pass, so admission sees the nodes at once
    assert [n.node_id for n in sqlite_store.list_nodes()] == ["n0"]
    survey.step()  # the second starts on its own thread and blocks there, not here
    assert launcher.started.wait(10)
    for _ in range(3):
        survey.step()  # passes go on while it waits; nothing new is stored
    assert launcher.calls == 2
    assert [n.node_id for n in sqlite_store.list_nodes()] == ["n0"]
    launcher.release.set()

    def stored_both() -> bool:
        survey.step()
        return len(sqlite_store.list_nodes()) == 2

    wait_for("the second inventory stored", stored_both)
    assert [(n.node_id, n.alive) for n in sqlite_store.list_nodes()] == [("n0", True),
                                                                         ("n1", True)]
    survey.close()


def test_a_failed_inventory_keeps_the_recorded_nodes(sqlite_store: Store) -> None:
    class Failing:
        calls = 0

        def inventory(self) -> list[dict[str, Any]]:
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("node n0 did not answer")
            return [{"node_id": "n0", "hostname": "h0"}]

    launcher = Failing()
    survey = NodeSurvey(sqlite_store, launcher, every_s=0.0)  # type: ignore[arg-type]
    survey.step()
    survey.step()

    def third_started() -> bool:
        survey.step()  # stores nothing from the failure, and starts the next one
        return launcher.calls >= 3

    wait_for("a third inventory", third_started)
    assert launcher.calls >= 3
    assert [(n.node_id, n.alive) for n in sqlite_store.list_nodes()] == [("n0", True)]
    survey.close()


def test_a_node_that_dies_or_joins_is_surveyed_at_once_not_when_the_period_is_over(
        sqlite_store: Store) -> None:
    class Changing:
        """A cluster whose live nodes are `live`; its inventory lists them."""

        def __init__(self) -> None:
            self.live = ["n0", "n1"]
            self.calls = 0

        def total_capacity(self) -> list[NodeCapacity]:
            return [NodeCapacity(n, 2.0, 0.0) for n in self.live]

        def inventory(self) -> list[dict[str, Any]]:
            self.calls += 1
            return [{"node_id": n, "hostname": n} for n in self.live]

    launcher = Changing()
    survey = NodeSurvey(sqlite_store, launcher, every_s=3600.0,  # type: ignore[arg-type]
                        watch_every_s=0.0)
    survey.step()
    for _ in range(3):
        survey.step()  # nothing changed: no inventory before the hour is over
    assert launcher.calls == 1
    launcher.live = ["n0", "n2"]  # n1 died, n2 joined

    def stored() -> bool:
        survey.step()
        return {n.node_id for n in sqlite_store.list_nodes() if n.alive} == {"n0", "n2"}

    wait_for("the new nodes in the inventory", stored)
    assert launcher.calls == 2
    survey.close()
