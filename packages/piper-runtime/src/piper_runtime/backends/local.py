"""The ``local`` backend: every rank a thread of one process (the ``local`` runtime), on the CPU.

Each communicator is a gloo process group made for its members alone, outside
``torch.distributed``'s one default world per process (which threads cannot each join):
the groups of one run meet in an in-process store, and gloo's pairs connect over loopback.
So a collective computes exactly what the ``cpu`` backend's does between processes (the same
gloo operations in the same order: results equal bit for bit), and nothing listens beyond
127.0.0.1.

Seeded forwards hold a process-wide lock (``piper_semantics.randomness``); a rank waiting
inside one (a tensor-parallel all-reduce, an expert all-to-all) lets its peers' forwards in
meanwhile (``yielding``), and draws on as if it had never waited.

``abort`` (the driver's, on a failed run) aborts every group, so no rank thread stays blocked
in a wait for a peer that will not come.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from piper_runtime.backends.cpu import GlooCommunicator
from piper_runtime.backends.host import HostStreams
from piper_runtime.rank.memory import MemoryTracker
from piper_runtime.rank.process import TORCH_THREADS
from piper_runtime.rendezvous import LOOPBACK
from piper_semantics.randomness import yielding

_stores: dict[int, dist.Store] = {}
_stores_lock = threading.Lock()
_worlds = itertools.count(1)


def new_world() -> int:
    """A key for one run's in-process store (what the ``local`` runtime passes as the port)."""
    return next(_worlds)


def _store(world: int) -> dist.Store:
    with _stores_lock:
        return _stores.setdefault(world, dist.HashStore())


def forget_world(world: int) -> None:
    """Drop a finished run's store."""
    with _stores_lock:
        _stores.pop(world, None)


class LocalBackend(HostStreams):
    """gloo groups between threads of one process, one host thread per lane (module doc)."""

    name = "local"
    gpus_per_rank = 0.0

    def __init__(self) -> None:
        self._tags = 0
        self._rank = 0
        self._world = 0
        self._timeout = timedelta(seconds=60)
        self._groups: list[dist.ProcessGroupGloo] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def connect(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> None:
        """Join the run keyed by ``master_port`` (``new_world``); ``master_addr`` is unused."""
        self._rank, self._world = rank, master_port
        self._timeout = timedelta(seconds=timeout_s)

    def communicator(self, ranks: Sequence[int], channels: Sequence[tuple[int, int]] = ()) -> GlooCommunicator:
        self._tags += 1  # every rank counts every group, member or not: the tags agree
        members = sorted(ranks)
        if self._rank not in members:
            return GlooCommunicator(None, ranks, self._tags)
        prefix = dist.PrefixStore(f"group{self._tags}", _store(self._world))
        rank, size = members.index(self._rank), len(members)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        options._timeout = self._timeout
        backend = dist.ProcessGroupGloo(prefix, rank, size, options)
        group = dist.ProcessGroup(prefix, rank, size)
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        self._groups.append(backend)
        return GlooCommunicator(group, ranks, self._tags, waiting=yielding)

    @contextlib.contextmanager
    def lane(self, stream: str) -> Iterator[None]:
        # torch's intra-op threads are a setting of each thread under OpenMP: a lane computes
        # with as many as a worker process's threads do, so its sums round alike.
        torch.set_num_threads(TORCH_THREADS)
        yield

    def memory_tracker(self, rank: int) -> MemoryTracker:
        return MemoryTracker(rank)

    def abort(self) -> None:
        """Abort every group: waits on them end with an error at once."""
        for backend in self._groups:
            try:
                backend.abort()
            except Exception:  # already aborted or shut down
                pass

    def shutdown(self) -> None:
        groups, self._groups = self._groups, []
        for backend in groups:
            try:
                backend.shutdown()
            except Exception:
                pass
