"""The environment of the Ray that Trident starts: Ray's metrics collection off and its workers
at niceness 0, on the head and on its driver (the controller), whose ranks then need no
runtime environment; a Ray Trident did not start keeps giving its ranks one. (That the head's
processes run so is checked on real ones in test_e2e_loopback.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cluster.rayhead import (
    NO_AUTOSCALER_MONITOR,
    NO_LOG_MONITOR,
    UNUSED_OFF_ENV,
    WORKER_NICENESS_ENV,
    RayHead,
)
from service.cluster.raynode import ray_start_argv
from workers.rank.actor import NICENESS_VAR, RANK_RUNTIME_ENV, rank_runtime_env


def test_the_head_and_its_driver_run_with_metrics_off_and_workers_at_niceness_0(
        tmp_path: Path) -> None:
    head = RayHead(tmp_path)
    wanted = {**UNUSED_OFF_ENV, **WORKER_NICENESS_ENV}
    assert wanted == {"RAY_enable_metrics_collection": "0", NICENESS_VAR: "0"}
    driver = head.env()  # what `trident up` gives the controller
    assert {k: driver.get(k) for k in wanted} == wanted
    assert head.supervisor.env is not None
    assert {k: head.supervisor.env.get(k) for k in wanted} == wanted
    argv = head.supervisor.argv
    assert "--include-dashboard=false" in argv and "--disable-usage-stats" in argv
    assert NO_LOG_MONITOR in argv and NO_AUTOSCALER_MONITOR in argv


@pytest.mark.parametrize("head", [True, False])
def test_nodes_that_trident_node_start_starts_run_no_log_monitor(head: bool) -> None:
    argv = ray_start_argv(head=head, address="127.0.0.1:6379", num_cpus=1, num_gpus=0,
                          labels={}, node_ip=None, temp_dir=None)
    assert NO_LOG_MONITOR in argv
    assert ("--include-dashboard=false" in argv) == head
    assert NO_AUTOSCALER_MONITOR not in argv  # an operator's `ray status` reads it


def test_ranks_take_a_runtime_environment_only_where_workers_start_niced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NICENESS_VAR, "0")
    assert rank_runtime_env() is None
    monkeypatch.delenv(NICENESS_VAR)
    assert rank_runtime_env() == RANK_RUNTIME_ENV
    monkeypatch.setenv(NICENESS_VAR, "15")
    assert rank_runtime_env() == RANK_RUNTIME_ENV
