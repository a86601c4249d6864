"""Gang admission: priority order, TP-group bundles packed onto nodes, impossible jobs."""

from __future__ import annotations

from datetime import UTC, datetime

from service.cluster.data_plane import NodeCapacity
from service.contract.spec import JobSpec
from service.policy.scheduler import Bundle, admit, bundles, pack
from tests.conftest import tiny_spec
from tests.fakes import job

NOW = datetime.now(UTC)
SPEC = JobSpec.model_validate(tiny_spec())


def nodes(*caps: tuple[float, float]) -> list[NodeCapacity]:
    return [NodeCapacity(f"n{i}", c, g) for i, (c, g) in enumerate(caps)]


def test_one_bundle_per_tp_group() -> None:
    assert bundles(job(1, world=8, tp=4, cpus=2, gpus=1)) == [Bundle(8, 4), Bundle(8, 4)]


def test_tp_groups_never_split_across_nodes() -> None:
    # 2 nodes of 4 GPUs: tp4 x dp2 fits (one group per node); tp8 does not, though 8 GPUs exist.
    two = nodes((32, 4), (32, 4))
    assert pack(bundles(job(1, world=8, tp=4, gpus=1)), two) == [0, 1]
    assert pack(bundles(job(2, world=8, tp=8, gpus=1)), two) is None


def test_admission_in_priority_order_stops_at_first_misfit() -> None:
    free = nodes((4, 0))
    queued = [job(1, world=2, priority=5), job(2, world=4, priority=3), job(3, world=1)]
    adm = admit(queued, free, free)
    # job 1 takes 2 CPUs; job 2 needs 4 and waits; job 3 must not jump ahead of it.
    assert [j.id for j in adm.admitted] == [1]
    assert not adm.impossible


def test_admitted_jobs_consume_capacity() -> None:
    free = nodes((2, 0), (2, 0))
    adm = admit([job(1, world=2, tp=2), job(2, world=2, tp=2), job(3, world=1)], free, free)
    assert [j.id for j in adm.admitted] == [1, 2]


def test_jobs_that_can_never_fit_are_reported_not_blocking() -> None:
    total = nodes((8, 4), (8, 4))
    adm = admit([job(1, world=16, gpus=1), job(2, world=4, gpus=1)], total, total)
    assert [j.id for j in adm.admitted] == [2]
    (bad, why), = adm.impossible
    assert bad.id == 1 and "16 GPUs" in why and "the cluster has 16 CPUs and 8 GPUs" in why


def test_a_restarting_job_keeps_its_room_by_its_priority() -> None:
    free = nodes((4, 0))
    restarting = [job(2, world=2, priority=5)]
    queued = [job(1, world=2, priority=9), job(3, world=1, priority=0), job(4, world=1)]
    adm = admit(queued, free, free, restarting=restarting)
    # job 1 (higher) goes first; job 2's room is kept, never admitted; jobs 3 and 4 get the rest
    # (none of job 2's).
    assert [j.id for j in adm.admitted] == [1] and [j.id for j in adm.reserved] == [2]
    assert adm.blocked is not None and adm.blocked.id == 3
    # Its room not free yet (its old group holds it): admission stops at it.
    adm = admit([job(3, world=1)], nodes((1, 0)), free, restarting=restarting)
    assert not adm.admitted and adm.blocked is not None and adm.blocked.id == 2
