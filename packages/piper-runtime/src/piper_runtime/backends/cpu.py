"""The CPU backend: gloo process groups, streams as host threads (``HostStreams``).

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
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from piper_runtime.backends.host import HostStreams
from piper_runtime.memory import MemoryTracker
from piper_runtime.rendezvous import make_store, set_socket_interfaces

# The non-deprecated names of the flat collectives (torch >= 2.13), else the older ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GlooCommunicator:
    """A ``Communicator`` on one gloo process group (``piper_runtime.backends.base``)."""

    def __init__(self, group: Any, ranks: Sequence[int], tag: int) -> None:
        self.group = group
        self.ranks = tuple(ranks)
        self.tag = tag

    def send(self, tensor: torch.Tensor, peer: int) -> Any:
        return dist.isend(tensor, dst=peer, group=self.group, tag=self.tag)

    def recv(self, tensor: torch.Tensor, peer: int) -> Any:
        return dist.irecv(tensor, src=peer, group=self.group, tag=self.tag)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        _reduce_scatter(output, input, group=self.group)

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Any:
        return _reduce_scatter(output, input, group=self.group, async_op=True)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        _all_gather(output, input, group=self.group)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> None:
        out_splits = None if output_splits is None else list(output_splits)
        in_splits = None if input_splits is None else list(input_splits)
        dist.all_to_all_single(output, input, out_splits, in_splits, group=self.group)


class CpuBackend(HostStreams):
    """gloo on the CPU, one host thread per lane (module doc)."""

    name = "cpu"
    gpus_per_rank = 0.0

    def __init__(self) -> None:
        self._tags = 0
        self._timeout: timedelta | None = None  # per operation, from connect

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def connect(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> None:
        if dist.is_initialized():  # a test process that already joined a world reuses it
            return
        set_socket_interfaces(master_addr, ("GLOO_SOCKET_IFNAME",))
        self._timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            "gloo",
            store=make_store(rank, world_size, master_addr, master_port, timeout_s),
            rank=rank,
            world_size=world_size,
            timeout=self._timeout,
        )

    def communicator(self, ranks: Sequence[int], channels: Sequence[tuple[int, int]] = ()) -> GlooCommunicator:
        self._tags += 1
        return GlooCommunicator(dist.new_group(sorted(ranks), timeout=self._timeout), ranks, self._tags)

    def memory_tracker(self, rank: int) -> MemoryTracker:
        return MemoryTracker(rank)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
