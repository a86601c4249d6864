"""Where a job's ranks meet: the rendezvous store and the sockets of the process groups, bound
to the job's master address instead of every interface.

With `init_method="tcp://ADDR:PORT"` torch's rank 0 serves its TCPStore on every interface
(`::`: TCPStore takes no address to bind), and gloo listens on whatever the host name
resolves to. On the embedded stack (Ray on 127.0.0.1, so the master address is loopback) that
would open a job's rendezvous and collectives to other hosts. `init_process_group` does it
the other way round: rank 0 binds the store's listening socket itself, to the master address,
and hands it to the store (`TCPStore(master_listen_fd=...)`); every rank joins the default
group through that store; and every rank's gloo sockets (`GLOO_SOCKET_IFNAME`) listen on the
interface through which this host reaches the master: loopback on the embedded stack, the
node's own address on a cluster of several hosts. On one host, NCCL's bootstrap is kept on
loopback the same way (`NCCL_SOCKET_IFNAME`); across hosts NCCL keeps its own choice. A
variable the job's `env` sets wins over ours.

Called wherever a rank initialises torch.distributed: `workers.trainer.train` (before
`deepspeed.init_distributed`, which then finds the group initialised), the job's bandwidth
probe (`workers.rank.actor`) and `trident probe` (`workers.monitor.cluster_probe_rank`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout


def init_process_group(backend: str, *, rank: int, world_size: int, master_addr: str,
                       port: int, timeout: timedelta | None = None,
                       device_id: torch.device | None = None) -> None:
    """torch.distributed's default group for this rank, with its store on `master_addr:port`
    (served by rank 0) and every socket of it on the master's side of this host; `timeout`:
    of the store and the group (None: torch's default for the backend)."""
    if timeout is None:
        timeout = default_pg_nccl_timeout if backend == "nccl" else default_pg_timeout
        assert timeout is not None, "NCCL backend asked of a torch built without NCCL"
    os.environ.update(socket_env(master_addr, port, os.environ))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun its agent already serves the store at MASTER_ADDR:MASTER_PORT.
        dist.init_process_group(backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device_id)
        return
    store = dist.TCPStore(master_addr, port, world_size, is_master=rank == 0, timeout=timeout,
                          master_listen_fd=listen_fd(master_addr, port) if rank == 0 else None)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device_id)


def listen_fd(addr: str, port: int) -> int:
    """A socket listening on `addr:port` only; the store owns its descriptor (and closes it)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A previous attempt's connections may hold the port in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen()
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"rendezvous: cannot listen on {addr}:{port}: {exc.strerror}"
                      ) from exc
    return sock.detach()


def socket_env(master_addr: str, port: int, env: Mapping[str, str]) -> dict[str, str]:
    """The variables that keep this rank's gloo (and, on one host, NCCL's bootstrap) on the
    interface through which it reaches the master; none that `env` already sets."""
    local = local_address(master_addr, port)
    iface = interface_of(local)
    out = {}
    if "GLOO_SOCKET_IFNAME" not in env:
        out["GLOO_SOCKET_IFNAME"] = iface
    if ipaddress.ip_address(local).is_loopback and "NCCL_SOCKET_IFNAME" not in env:
        out["NCCL_SOCKET_IFNAME"] = f"={iface}"  # "=": this interface, not a name prefix
    return out


def local_address(master_addr: str, port: int) -> str:
    """The address of this host that its packets to the master leave from: the master's own
    address on the master's host, loopback when the master is on loopback."""
    family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)  # UDP: the kernel picks the route and the source; nothing is sent
        return str(s.getsockname()[0]).split("%")[0]


def interface_of(address: str) -> str:
    """The network interface that holds `address` (or, failing that, whose network has it:
    127.0.0.2 is on `lo`)."""
    ip = ipaddress.ip_address(address)
    on_network = None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6) or not a.netmask:
                continue
            bits = bin(int(ipaddress.ip_address(a.netmask))).count("1")
            net = ipaddress.ip_interface(f"{a.address.split('%')[0]}/{bits}")
            if net.ip == ip:
                return name
            if on_network is None and ip in net.network:
                on_network = name
    if on_network is None:
        raise OSError(f"rendezvous: no network interface of this host holds {address}")
    return on_network
