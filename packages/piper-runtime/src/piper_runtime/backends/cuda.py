"""The CUDA backend: cupy streams and events, NCCL communicators, one GPU per rank (or a
share of one).

NOT VERIFIED ON A GPU YET: every part below runs in the test suite on CPU against fakes
(``piper_runtime.backends.fakes``: a device that logs what is queued on which stream, NCCL
among threads), and the real-GPU tests and ``benchmarks/gpu_check.sh`` are ready for a
machine that has one.

- Device: GPU 0 of what the process sees (Ray gives each rank's actor its own GPU through
  ``CUDA_VISIBLE_DEVICES``). Nothing touches the GPU until the worker asks for ``device``,
  so the driver can build this backend to read its needs on a machine without one.
- Streams and events: ``DeviceStreams`` (one cupy stream per logical stream, events
  recorded and waited on the device, lanes that fork from and join into the worker's
  stream).
- Connect: joins a *host world* first (gloo over the rendezvous store, ``GlooWorld``), which
  carries what NCCL cannot: each rank's GPU identity, the NCCL unique ids (through the
  store), and the host-staged communicators of ranks that share a GPU.
- Communicators (``communicator(ranks, channels)``, every rank, one order): a collective group
  is an ``NcclGroup`` unless two members share a GPU (then ``StagedCommunicator`` over a gloo
  group); a point-to-point communicator is ``NcclChannels``, one two-rank NCCL communicator
  and stream per (sender, receiver), host-staged where both ends share a GPU
  (``gpu_plan``). All NCCL communicators are created here, at set-up, in one order on every
  rank (each creation waits for its members only; the common order rules out a cycle).
- Memory: ``DeviceMemoryTracker`` adds the CUDA caching allocator's peak allocated bytes
  over the step (``RankMemory.device_peak``) to the per-category counts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol

import attrs
import torch

from piper_ir import ClusterError
from piper_runtime.backends.base import Communicator
from piper_runtime.backends.device import Device
from piper_runtime.backends.device_streams import DeviceStreams, LaneEvent
from piper_runtime.backends.gpu_plan import Transport, channel_transports, group_transport
from piper_runtime.backends.nccl import Channel, CupyNccl, NcclChannels, NcclGroup, NcclLibrary
from piper_runtime.backends.staged import StagedCommunicator
from piper_runtime.rank.memory import MemoryTracker, RankMemory

INSTALL_HINT = "pip install 'piper-runtime[cuda]' (cupy-cuda12x)"


def cuda_missing() -> str | None:
    """What this process lacks for the CUDA backend, in words; ``None`` if nothing."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False here (no GPU visible, or a CPU-only torch build)"
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return f"cupy with NCCL is not importable ({exc}); {INSTALL_HINT}"
    if not getattr(nccl, "available", True):
        return f"cupy was built without NCCL; {INSTALL_HINT}"
    return None


class HostWorld(Protocol):
    """The host-side world a CUDA backend joins first: a key-value store and host groups."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> str:
        """The value of ``key``, waiting for another rank to set it."""
        ...

    def communicator(self, ranks: Sequence[int]) -> Communicator:
        """A group on host tensors; every rank calls this for every group, in one order."""
        ...

    def shutdown(self) -> None: ...


JoinHost = Callable[[int, int, str, int, float], HostWorld]  # (rank, world size, address, port, timeout)


class GlooWorld:
    """``HostWorld`` on gloo and the rendezvous store (``piper_runtime.rendezvous``)."""

    def __init__(self, store: Any, timeout: timedelta | None = None) -> None:
        self.store = store
        self.timeout = timeout  # of every group's operations (torch's default is 30 minutes)
        self._tags = 0

    @classmethod
    def join(cls, rank: int, world_size: int, address: str, port: int, timeout_s: float) -> GlooWorld:
        import torch.distributed as dist

        from piper_runtime.rendezvous import make_store, set_socket_interfaces

        set_socket_interfaces(address)  # gloo's and NCCL's sockets on this rank's interface
        store = make_store(rank, world_size, address, port, timeout_s)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        return cls(store, timedelta(seconds=timeout_s))

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> str:
        return self.store.get(key).decode()

    def communicator(self, ranks: Sequence[int]) -> Communicator:
        import torch.distributed as dist

        from piper_runtime.backends.cpu import GlooCommunicator

        self._tags += 1
        return GlooCommunicator(dist.new_group(sorted(ranks), timeout=self.timeout), ranks, self._tags)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class DeviceMemoryTracker(MemoryTracker):
    """``MemoryTracker`` plus the allocator's peak allocated bytes over the step."""

    def __init__(self, rank: int, device: Device) -> None:
        self.gpu = device
        super().__init__(rank)

    def reset(self, excluded: Any = ()) -> None:
        super().reset(excluded)
        self.gpu.reset_peak()

    def result(self) -> RankMemory:
        return attrs.evolve(super().result(), device_peak=self.gpu.peak_bytes())


class CudaBackend:
    """The CUDA backend (module doc). ``device``, ``nccl`` and ``join`` default to the real
    ones (``CupyDevice``, ``CupyNccl``, ``GlooWorld.join``); tests pass fakes."""

    name = "cuda"
    gpus_per_rank = 1.0

    def __init__(
        self, device: Device | None = None, nccl: NcclLibrary | None = None, join: JoinHost | None = None
    ) -> None:
        self._gpu = device
        self._streams: DeviceStreams | None = DeviceStreams(device) if device is not None else None
        self._nccl = nccl
        self._join = join or GlooWorld.join
        self._host: HostWorld | None = None
        self._comms: list[Any] = []
        self.rank = -1
        self.identities: tuple[str, ...] = ()
        # (ranks of a group or (sender, receiver) of a channel) -> how it communicates
        self.transports: list[tuple[tuple[int, ...], Transport]] = []

    # -- the device and its streams --------------------------------------------------------------

    @property
    def gpu(self) -> Device:
        if self._gpu is None:
            missing = cuda_missing()
            if missing:
                raise ClusterError(f"backend 'cuda' cannot run in this worker: {missing}")
            from piper_runtime.backends.device import CupyDevice

            self._gpu = CupyDevice(0)
        return self._gpu

    @property
    def device(self) -> torch.device:
        return self.gpu.device

    @property
    def streams(self) -> DeviceStreams:
        if self._streams is None:
            self._streams = DeviceStreams(self.gpu)
        return self._streams

    def event(self, name: str) -> LaneEvent:
        return self.streams.event(name)

    def lane(self, stream: str) -> AbstractContextManager[None]:
        return self.streams.lane(stream)

    # -- the world and its communicators ------------------------------------------------------------

    def connect(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> None:
        gpu = self.gpu
        self.rank = rank
        self._host = host = self._join(rank, world_size, master_addr, master_port, timeout_s)
        host.set(f"piper/gpu/{rank}", gpu.identity())
        self.identities = tuple(host.get(f"piper/gpu/{r}") for r in range(world_size))
        if self._nccl is None:
            self._nccl = CupyNccl()

    def communicator(self, ranks: Sequence[int], channels: Sequence[tuple[int, int]] = ()) -> Communicator:
        if self._host is None:
            raise RuntimeError("communicator() before connect()")
        index = len(self._comms)
        ranks = tuple(ranks)
        comm: Any
        if channels:
            comm = self._channels(index, ranks, channels)
        elif group_transport(ranks, self.identities) is Transport.HOST:
            comm = StagedCommunicator(self._host.communicator(ranks), self.gpu)
            self.transports.append((ranks, Transport.HOST))
        else:
            member = self.rank in ranks
            comm = NcclGroup(
                ranks,
                self.rank,
                self._nccl_comm(f"{index}", ranks) if member else None,
                self._nccl,
                self.gpu,
                self.gpu.new_stream(f"comm{index}.side") if member else None,
            )
            self.transports.append((ranks, Transport.NCCL))
        self._comms.append(comm)
        return comm

    def _channels(self, index: int, ranks: tuple[int, ...], channels: Sequence[tuple[int, int]]) -> NcclChannels:
        found: dict[tuple[int, int], Any] = {}
        for (src, dst), how in channel_transports(channels, self.identities).items():
            self.transports.append(((src, dst), how))
            if how is Transport.HOST:
                host = self._host.communicator((src, dst))  # every rank makes every gloo group
                if self.rank in (src, dst):
                    found[(src, dst)] = StagedCommunicator(host, self.gpu)
            elif self.rank in (src, dst):
                comm = self._nccl_comm(f"{index}/{src}-{dst}", (src, dst))
                peer = 1 if self.rank == src else 0
                found[(src, dst)] = Channel(comm, peer, self.gpu, self.gpu.new_stream(f"comm{index}.{src}->{dst}"))
        return NcclChannels(ranks, self.rank, found)

    def _nccl_comm(self, key: str, ranks: Sequence[int]) -> Any:
        """Join NCCL communicator ``key`` over ``ranks``: its first member makes the unique
        id and publishes it in the store, the others read it there."""
        store_key = f"piper/nccl/{key}"
        if self.rank == ranks[0]:
            unique_id = self._nccl.unique_id()
            self._host.set(store_key, json.dumps(unique_id))
        else:
            unique_id = json.loads(self._host.get(store_key))
        return self._nccl.communicator(len(ranks), unique_id, list(ranks).index(self.rank))

    def memory_tracker(self, rank: int) -> MemoryTracker:
        return DeviceMemoryTracker(rank, self.gpu)

    def shutdown(self) -> None:
        if self._gpu is not None:
            try:
                self._gpu.synchronize()
            finally:
                for comm in self._comms:
                    destroy = getattr(comm, "destroy", None)
                    if destroy is not None:
                        destroy()
                self._comms.clear()
        if self._host is not None:
            self._host.shutdown()
            self._host = None


def cuda_backend() -> CudaBackend:
    """The registered factory: an unconnected backend that has not touched the GPU yet."""
    return CudaBackend()
