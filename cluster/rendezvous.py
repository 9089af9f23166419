"""Rendezvous of one EP group's ranks into `torch.distributed` process groups.

Rank 0 picks a free port on its node and publishes `address:port` in Ray's internal KV under the
group's id; the other ranks poll for it (bounded). Every rank then joins one default process group
(NCCL on CUDA, gloo on CPU) used for the MoE all-to-all, plus a separate gloo group for the
per-step lockstep header. Both carry a timeout so that a dead peer makes a collective fail instead
of hanging forever.

Group ids are unique per incarnation (Serve gives every restarted gang a new id; offline groups use
a fresh uuid), so a stale key from a dead group can never be read by a new one.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

from engine.parallel import SINGLE_RANK, ParallelContext

logger = logging.getLogger(__name__)

KV_NAMESPACE = "moe_serve"
_KEY_PREFIX = "ep_master/"

DEFAULT_RENDEZVOUS_TIMEOUT_S = 120.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


class RendezvousTimeoutError(TimeoutError):
    """Rank 0 of the group never published its address within the rendezvous timeout."""


@dataclass(frozen=True)
class MasterAddress:
    address: str
    port: int
    node_id: str

    @property
    def init_method(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"tcp://{host}:{self.port}"


def _key(group_id: str) -> str:
    return _KEY_PREFIX + group_id


def node_address() -> str:
    """The address peers reach this node on: Ray's own node IP (127.0.0.1 for a loopback cluster)."""
    import ray

    return ray.util.get_node_ip_address()


def free_port(address: str) -> int:
    """A port free on `address` right now. The socket is closed before torch binds it, so another
    process could take it in between; that makes the group fail to form, and the gang restarts."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def publish_master(group_id: str, master: MasterAddress) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(
        _key(group_id), json.dumps(asdict(master)), overwrite=True, namespace=KV_NAMESPACE
    )


def withdraw_master(group_id: str) -> None:
    """Remove the group's key once every rank has joined (nobody needs it afterwards)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_key(group_id), namespace=KV_NAMESPACE)


def wait_for_master(group_id: str, timeout_s: float, poll_s: float = 0.2) -> MasterAddress:
    from ray.experimental import internal_kv

    deadline = time.monotonic() + timeout_s
    while True:
        raw = internal_kv._internal_kv_get(_key(group_id), namespace=KV_NAMESPACE)
        if raw:
            return MasterAddress(**json.loads(raw))
        if time.monotonic() >= deadline:
            raise RendezvousTimeoutError(
                f"EP group {group_id!r}: rank 0 did not publish its address within {timeout_s:.0f} s "
                f"(KV namespace {KV_NAMESPACE!r}, key {_key(group_id)!r}); rank 0 failed to start or "
                "was never scheduled"
            )
        time.sleep(poll_s)


def _pin_gloo_to_loopback(address: str) -> None:
    """Gloo picks its interface from the hostname, which on many hosts is not loopback. When the
    group lives on 127.0.0.1 (a single-machine cluster, tests) pin gloo to `lo` unless the operator
    already chose an interface."""
    if ipaddress.ip_address(address).is_loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def init_ep_process_groups(
    rank: int,
    world_size: int,
    group_id: str,
    *,
    device: str,
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    master_address: str | None = None,
) -> ParallelContext:
    """Join this process to its EP group and return the engine's `ParallelContext`.

    `master_address` is what rank 0 binds and publishes (default: its Ray node IP); pass
    127.0.0.1 to keep a single-machine group on loopback. Must run inside a Ray worker (it uses
    the internal KV) and once per process: the default `torch.distributed` group is process-global.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    if world_size == 1:
        return SINGLE_RANK
    import ray
    import torch.distributed as dist

    if rank == 0:
        address = master_address or node_address()
        master = MasterAddress(address, free_port(address), ray.get_runtime_context().get_node_id())
        publish_master(group_id, master)
    else:
        master = wait_for_master(group_id, rendezvous_timeout_s)
    _pin_gloo_to_loopback(master.address)
    if device == "cuda":
        # Ray exposes exactly this rank's GPU, so it is device 0 of the process.
        import torch

        torch.cuda.set_device(0)
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = timedelta(seconds=collective_timeout_s)
    logger.info(
        "EP group %s: rank %d/%d joining %s via %s",
        group_id,
        rank,
        world_size,
        backend,
        master.init_method,
    )
    # Rank 0 waits here for all peers, so this is bounded by the same timeout as collectives.
    dist.init_process_group(
        backend, init_method=master.init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    ep_group = dist.group.WORLD
    # The lockstep header travels on its own gloo group so it never interleaves with the MoE
    # collectives of a forward still in flight (overlap scheduler).
    control_group = dist.new_group(backend="gloo", timeout=timeout)
    # new_group is collective: once it returns, every rank has read the address.
    if rank == 0:
        withdraw_master(group_id)
    return ParallelContext(
        rank=rank, world_size=world_size, ep_group=ep_group, control_group=control_group
    )


def destroy_ep_process_groups() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
