"""A job's rendezvous listens on its master address only (`workers.runtime.rendezvous`): the store
of rank 0 and every rank's gloo sockets, on loopback when the master is on loopback and on the
node's address when it is not (as on a cluster of several hosts). Real processes, real gloo;
the sockets as the kernel lists them (psutil)."""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch
import torch.multiprocessing as mp

from workers.runtime.rendezvous import init_process_group, interface_of, listen_fd, socket_env


def _address_of_this_host(loopback: bool) -> str | None:
    """An IPv4 address of one of this host's interfaces, on loopback or not."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and \
                    ipaddress.ip_address(a.address).is_loopback == loopback:
                return str(a.address)
    return None


LOOPBACK = _address_of_this_host(loopback=True) or "127.0.0.1"
NODE = _address_of_this_host(loopback=False)
"""A node's address, as Ray gives it on a cluster of several hosts (None: this host has none)."""


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, addr: str, port: int, queue: Any) -> None:
    import torch.distributed as dist

    try:
        init_process_group("gloo", rank=rank, world_size=world, master_addr=addr, port=port,
                           timeout=timedelta(seconds=120))
        sub = dist.new_group([0, 1])  # the TP/PP/DP groups are built like this
        x = torch.ones(4)
        dist.all_reduce(x)
        dist.all_reduce(x, group=sub)
        sockets = [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                   if c.status == psutil.CONN_LISTEN]
        queue.put((rank, float(x[0]), sockets, None))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:
        queue.put((rank, None, [], repr(exc)))


def _listening_ranks(addr: str) -> dict[int, tuple[float, list[tuple[str, int]]]]:
    """Two ranks meet at `addr`, run collectives on the world and a subgroup, and say what
    they listen on: rank -> (the all-reduced value, [(address, port)])."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port(addr)
    procs = [ctx.Process(target=_rank_main, args=(r, 2, addr, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in procs:
            rank, value, sockets, error = queue.get(timeout=180)
            assert error is None, f"rank {rank}: {error}"
            out[rank] = (value, sockets)
        return out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["loopback", "node"])
def test_a_groups_store_and_gloo_sockets_listen_on_the_master_address_only(
        where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    addr = LOOPBACK if where == "loopback" else NODE
    if addr is None:
        pytest.skip("this host has no address beyond loopback")
    # The ranks inherit this process's environment: an earlier test of the same worker that
    # met in-process leaves its interface there, and the rendezvous keeps what a job sets.
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    ranks = _listening_ranks(addr)
    assert {r: value for r, (value, _) in ranks.items()} == {0: 4.0, 1: 4.0}
    # Rank 0 serves the store and gloo pairs; rank 1 its gloo pairs; none beyond the master's
    # address (without the rendezvous, rank 0's store listens on `::`, gloo where the host
    # name points).
    assert all(sockets for _, sockets in ranks.values()), ranks
    elsewhere = [(r, s) for r, (_, sockets) in ranks.items() for s in sockets if s[0] != addr]
    assert not elsewhere, elsewhere


def test_gloo_and_nccl_bootstrap_follow_the_route_to_the_master_unless_the_job_sets_them():
    lo = interface_of(LOOPBACK)
    assert socket_env(LOOPBACK, 29500, {}) == {"GLOO_SOCKET_IFNAME": lo,
                                                "NCCL_SOCKET_IFNAME": f"={lo}"}
    # 127.0.0.2 is on the loopback interface's network, not one of its addresses.
    assert interface_of("127.0.0.2") == lo
    job = {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "ib"}
    assert socket_env(LOOPBACK, 29500, job) == {}
    if NODE is not None:
        # Across hosts NCCL chooses its interfaces itself (its data path may use others).
        assert socket_env(NODE, 29500, {}) == {"GLOO_SOCKET_IFNAME": interface_of(NODE)}
        assert interface_of(NODE) != lo
    with pytest.raises(OSError, match="no network interface of this host holds 203.0.113.9"):
        interface_of("203.0.113.9")  # TEST-NET-3: no host's address


def test_a_port_already_taken_is_an_error_naming_the_rendezvous_address() -> None:
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"rendezvous: cannot listen on {LOOPBACK}:{port}"):
            listen_fd(LOOPBACK, port)
    fd = listen_fd(LOOPBACK, port)  # free again: bound to that address only
    try:
        sock = socket.socket(fileno=os.dup(fd))
        assert sock.getsockname() == (LOOPBACK, port)
        sock.close()
    finally:
        os.close(fd)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccls_bootstrap_on_one_host_listens_on_loopback(monkeypatch) -> None:
    import torch.distributed as dist

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # what the rendezvous sets
        monkeypatch.setenv(name, "")  # goes when the test ends
        monkeypatch.delenv(name)
    port = _free_port(LOOPBACK)
    init_process_group("nccl", rank=0, world_size=1, master_addr=LOOPBACK, port=port,
                       device_id=torch.device("cuda", 0))
    try:
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        sockets = [c.laddr.ip for c in psutil.Process().net_connections("inet")
                   if c.status == psutil.CONN_LISTEN]
    finally:
        dist.destroy_process_group()
    assert sockets and all(ipaddress.ip_address(ip).is_loopback for ip in sockets), sockets
