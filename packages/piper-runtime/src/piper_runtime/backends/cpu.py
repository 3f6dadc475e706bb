"""The CPU backend: gloo process groups, streams as host threads (``HostStreams``), and
shared-memory channels for the point-to-point messages of ranks on one host.

Every communicator is a gloo process group of its own, so threads never issue two
collectives on one group concurrently (their order could then differ between ranks), and
each gets its own point-to-point tag, which keeps, e.g., activations and gradients between
the same two ranks in separate FIFO channels. gloo runs collectives and transfers on its own
threads and torch kernels release the GIL, so communication proceeds while another lane
computes.

``connect`` joins through ``piper_runtime.rendezvous``: the TCP store listens on the
rendezvous address only, and gloo's sockets use the interface owning this rank's address
(``GLOO_SOCKET_IFNAME``, unless set). ``connect``'s timeout also bounds every operation on
every group (a receive's wait, a collective): torch gives groups made by ``new_group`` 30
minutes otherwise, whatever the world's timeout.

Point-to-point messages between two ranks on one host (same host name, boot and
``/dev/shm`` mount) go through shared memory (``piper_runtime.backends.shm``): a
communicator opens one channel per (sender, receiver) pair it is told of, for the pairs on
one host, and uses gloo for the others. ``PIPER_SHM_DISABLE=1`` (read by each worker; the
driver forwards it) sends everything through gloo, as does a host without ``/dev/shm``, and
a group whose channels a member could not make or open (a full ``/dev/shm``; two processes
that do not see one ``/dev/shm`` after all): logged as a warning on that rank.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from piper_runtime.backends.host import HostStreams
from piper_runtime.backends.shm import SHM_DIR, ShmReceiver, ShmSender, open_channels, shm_available
from piper_runtime.rank.memory import MemoryTracker
from piper_runtime.rendezvous import make_store, set_socket_interfaces

SHM_DISABLE_ENV = "PIPER_SHM_DISABLE"


def host_identity() -> str:
    """What two processes that share one ``/dev/shm`` have in common: host name, boot, and
    the device of the ``/dev/shm`` mount (containers on one host each have their own)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        shm_device = os.stat(SHM_DIR).st_dev
    except OSError:
        boot, shm_device = "", -1
    return f"{socket.gethostname()}/{boot}/{shm_device}"


def shm_enabled() -> bool:
    return os.environ.get(SHM_DISABLE_ENV, "0") in ("", "0") and shm_available()


class GlooCommunicator:
    """A ``Communicator`` on one gloo process group (``piper_runtime.backends.base``); its
    point-to-point messages to ``senders``' peers and from ``receivers``' go through
    shared-memory channels instead (module doc). Calls go to the group object itself, as
    ``torch.distributed``'s functions do (the same gloo operations, so the same sums), with
    peers as group ranks: a group made outside the default world works alike
    (``piper_runtime.backends.local``). ``waiting``: what every wait runs under (the local
    backend lets a seeded forward's peers in meanwhile)."""

    def __init__(
        self,
        group: Any,
        ranks: Sequence[int],
        tag: int,
        senders: dict[int, ShmSender] | None = None,
        receivers: dict[int, ShmReceiver] | None = None,
        waiting: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        self.group = group
        self.ranks = tuple(ranks)
        self.tag = tag
        self.senders = senders or {}
        self.receivers = receivers or {}
        self._members = sorted(self.ranks)  # a group's ranks are its members' order
        self._waiting = waiting

    def _run(self, work: Any) -> None:
        with self._waiting():
            work.wait()

    def send(self, tensor: torch.Tensor, peer: int) -> Any:
        channel = self.senders.get(peer)
        if channel is not None:
            return channel.send(tensor)
        return _Waited(self.group.send([tensor], self._members.index(peer), self.tag), self._waiting)

    def recv(self, tensor: torch.Tensor, peer: int) -> Any:
        channel = self.receivers.get(peer)
        if channel is not None:
            return channel.recv(tensor)
        return _Waited(self.group.recv([tensor], self._members.index(peer), self.tag), self._waiting)

    def close(self) -> None:
        """Close the shared-memory channels (the gloo group goes with the world)."""
        for channel in (*self.senders.values(), *self.receivers.values()):
            channel.close()
        self.senders, self.receivers = {}, {}

    def all_reduce(self, tensor: torch.Tensor) -> None:
        opts = c10d.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._run(self.group.allreduce([tensor], opts))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._run(self.start_reduce_scatter(output, input))

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Any:
        opts = c10d.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return _Waited(self.group.reduce_scatter_single(output, input, opts), self._waiting)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._run(self.group.all_gather_single(output, input, c10d.AllgatherOptions()))

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> None:
        out_splits = [] if output_splits is None else list(output_splits)
        in_splits = [] if input_splits is None else list(input_splits)
        self._run(self.group.all_to_all_single(output, input, out_splits, in_splits, c10d.AllToAllOptions()))


class _Waited:
    """A gloo ``Work`` whose ``wait`` runs under the communicator's ``waiting``."""

    def __init__(self, work: Any, waiting: Callable[[], AbstractContextManager[object]]) -> None:
        self._work = work
        self._waiting = waiting

    def wait(self) -> None:
        with self._waiting():
            self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()


def all_agree(ok: bool, group: Any) -> bool:
    """Whether every member of ``group`` passed ``ok`` (a barrier as well)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class CpuBackend(HostStreams):
    """gloo on the CPU, one host thread per lane (module doc)."""

    name = "cpu"
    gpus_per_rank = 0.0

    def __init__(self) -> None:
        self._tags = 0
        self._timeout: timedelta | None = None  # per operation, from connect
        self._rank = 0
        self._hosts: tuple[str, ...] = ()  # per rank, ``host_identity``; empty: no shm
        self._prefix = ""  # of this world's shared-memory files
        self._communicators: list[GlooCommunicator] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def connect(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> None:
        if dist.is_initialized():  # a test process that already joined a world reuses it
            return
        set_socket_interfaces(master_addr, ("GLOO_SOCKET_IFNAME",))
        self._timeout = timedelta(seconds=timeout_s)
        store = make_store(rank, world_size, master_addr, master_port, timeout_s)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=self._timeout)
        self._rank = rank
        self._join_hosts(dist.PrefixStore("piper/hosts", store), rank, world_size)

    def _join_hosts(self, store: Any, rank: int, world_size: int) -> None:
        """Learn which ranks share a host, and a prefix for this world's files (every rank
        decides alike: a rank that cannot use shared memory opts the whole world out). Plain
        strings through the world's store (torch's ``all_gather_object`` would unpickle what
        peers send)."""
        store.set(f"host/{rank}", host_identity() if shm_enabled() else "")
        if rank == 0:
            store.set("prefix", f"piper-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}")
        hosts = tuple(store.get(f"host/{r}").decode() for r in range(world_size))  # waits, bounded by the store
        self._hosts = hosts if all(hosts) else ()
        self._prefix = store.get("prefix").decode()

    def _same_host(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        if not self._hosts:
            return []
        return [(s, r) for s, r in pairs if self._hosts[s] == self._hosts[r]]

    def communicator(self, ranks: Sequence[int], channels: Sequence[tuple[int, int]] = ()) -> GlooCommunicator:
        self._tags += 1
        group = dist.new_group(sorted(ranks), timeout=self._timeout)
        senders: dict[int, ShmSender] = {}
        receivers: dict[int, ShmReceiver] = {}
        local = self._same_host(channels)
        if local and self._rank in ranks:
            timeout_s = self._timeout.total_seconds() if self._timeout else 1800.0
            opened = open_channels(
                f"{self._prefix}-{self._tags}", self._rank, local, lambda ok: all_agree(ok, group), timeout_s
            )
            if opened is not None:  # else a member could not make its part: gloo carries them
                senders, receivers = opened
        comm = GlooCommunicator(group, ranks, self._tags, senders, receivers)
        self._communicators.append(comm)
        return comm

    def memory_tracker(self, rank: int) -> MemoryTracker:
        return MemoryTracker(rank)

    def shutdown(self) -> None:
        for comm in self._communicators:
            comm.close()
        self._communicators = []
        if dist.is_initialized():
            dist.destroy_process_group()
