"""NCCL communicators for the CUDA backend, through cupy's NCCL bindings.

Why cupy's bindings, not torch's NCCL process groups: a cupy ``NcclCommunicator`` queues
each operation on exactly the stream we pass, so the plan's streams and events are the
whole story (torch's process groups run every operation on an internal stream of their own
and synchronise with the caller's current stream behind our back); a communicator is made
by its members only, once, at set-up, from a unique id passed through the rendezvous store
(torch's groups need every rank of the world in every ``new_group`` and create NCCL
communicators lazily, inside the first operation, i.e. on a lane in the middle of a step);
and one communicator per channel direction is cheap to express. The cost: the caching
allocator does not know NCCL uses a tensor, so we tell it (``Device.keep``, i.e.
``record_stream``) wherever the stream differs from the one that allocated it.

- ``NcclGroup``: the collectives of one group, queued on the *current* stream, i.e. the
  stream of the lane running the instruction (a data-parallel reduction on the ``dp``
  stream, a tensor-parallel all-reduce inside compute on ``compute``). The one asynchronous
  collective, ``start_reduce_scatter`` (issued from gradient hooks during a backward), runs
  on a side stream of the group's own: the side stream first waits for an event on the
  current stream, the tensors are kept for it, and the returned ``Work.wait`` makes the
  waiter's stream wait for it (and keeps the output for the waiter's stream).
- ``NcclChannels``: the point-to-point traffic of one program communicator, one ``Channel``
  per (sender, receiver) with a stream of its own (``gpu_plan`` says why); a send or receive
  forks onto the channel's stream from the current one and ``Work.wait`` joins back.
  Receive buffers are kept for the channel's stream and for the stream that waits for them.
- ``NcclLibrary`` / ``NcclComm``: the few NCCL calls used, on tensors; ``CupyNccl`` is the
  real one (pointers, counts and datatypes for ``cupy.cuda.nccl``), the fakes in
  ``piper_runtime.backends.fakes`` stand in for it on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from piper_runtime.backends.base import Communicator, Work
from piper_runtime.backends.device import Device, DeviceEvent, Stream
from piper_runtime.backends.gpu_plan import NCCL_SUM, even_splits, nccl_dtype, split_offsets


class NcclComm(Protocol):
    """One NCCL communicator, seen from this rank (``peer`` and ``root`` are its own ranks)."""

    def send(self, tensor: torch.Tensor, peer: int, stream: Stream) -> None: ...
    def recv(self, tensor: torch.Tensor, peer: int, stream: Stream) -> None: ...
    def all_reduce(self, tensor: torch.Tensor, stream: Stream) -> None: ...
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, stream: Stream) -> None: ...
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: Stream) -> None: ...
    def destroy(self) -> None: ...


class NcclLibrary(Protocol):
    """Making communicators and grouping calls."""

    def unique_id(self) -> list[int]:
        """A new unique id (JSON-serialisable), made by a communicator's first member."""
        ...

    def communicator(self, size: int, unique_id: Sequence[int], rank: int) -> NcclComm:
        """Join the communicator ``unique_id`` as ``rank`` of ``size`` (blocks until all join)."""
        ...

    def group(self) -> AbstractContextManager[None]:
        """``ncclGroupStart`` / ``ncclGroupEnd`` around several calls."""
        ...


def _check(tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"NCCL needs contiguous tensors, got one of shape {tuple(tensor.shape)} and strides {tensor.stride()}")


class CupyNcclComm:
    """``NcclComm`` over ``cupy.cuda.nccl.NcclCommunicator`` (pointers and counts)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def send(self, tensor: torch.Tensor, peer: int, stream: Any) -> None:
        _check(tensor)
        self.comm.send(tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor.dtype), peer, stream.handle)

    def recv(self, tensor: torch.Tensor, peer: int, stream: Any) -> None:
        _check(tensor)
        self.comm.recv(tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor.dtype), peer, stream.handle)

    def all_reduce(self, tensor: torch.Tensor, stream: Any) -> None:
        _check(tensor)
        ptr = tensor.data_ptr()
        self.comm.allReduce(ptr, ptr, tensor.numel(), nccl_dtype(tensor.dtype), NCCL_SUM, stream.handle)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, stream: Any) -> None:
        _check(output)
        _check(input)
        self.comm.reduceScatter(
            input.data_ptr(), output.data_ptr(), output.numel(), nccl_dtype(output.dtype), NCCL_SUM, stream.handle
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: Any) -> None:
        _check(output)
        _check(input)
        self.comm.allGather(input.data_ptr(), output.data_ptr(), input.numel(), nccl_dtype(input.dtype), stream.handle)

    def destroy(self) -> None:
        self.comm.destroy()


class CupyNccl:
    """``NcclLibrary`` over ``cupy.cuda.nccl``."""

    def __init__(self) -> None:
        from cupy.cuda import nccl

        self.nccl = nccl

    def unique_id(self) -> list[int]:
        return list(self.nccl.get_unique_id())

    def communicator(self, size: int, unique_id: Sequence[int], rank: int) -> CupyNcclComm:
        return CupyNcclComm(self.nccl.NcclCommunicator(size, tuple(unique_id), rank))

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        self.nccl.groupStart()
        try:
            yield
        finally:
            self.nccl.groupEnd()


class DeviceWork:
    """A ``Work`` whose completion is a device event: ``wait`` makes the waiter's current
    stream wait for it (the host does not block) and keeps ``outputs`` for that stream."""

    def __init__(self, device: Device, done: DeviceEvent, outputs: Sequence[torch.Tensor] = ()) -> None:
        self.device = device
        self.done = done
        self.outputs = tuple(outputs)

    def wait(self) -> None:
        current = self.device.current_stream()
        current.wait(self.done)
        for t in self.outputs:
            self.device.keep(t, current)


def _fork(device: Device, onto: Stream, tensors: Sequence[torch.Tensor]) -> None:
    """``onto`` starts after the current stream's work so far; ``tensors`` are kept for it."""
    onto.wait(device.current_stream().record())
    for t in tensors:
        device.keep(t, onto)


class NcclGroup:
    """The collectives of one group (module doc); ``comm`` is ``None`` on a non-member."""

    def __init__(
        self,
        ranks: Sequence[int],
        rank: int,
        comm: NcclComm | None,
        nccl: NcclLibrary,
        device: Device,
        side: Stream | None,
    ) -> None:
        self.ranks = tuple(ranks)
        self.rank = rank
        self._comm = comm
        self.nccl = nccl
        self.device = device
        self.side = side

    @property
    def comm(self) -> NcclComm:
        if self._comm is None:
            raise RuntimeError(f"rank {self.rank} is not a member of the group {list(self.ranks)}")
        return self._comm

    def send(self, tensor: torch.Tensor, peer: int) -> Work:
        raise RuntimeError(f"group {list(self.ranks)} carries collectives only; the plan names no channel to {peer}")

    def recv(self, tensor: torch.Tensor, peer: int) -> Work:
        raise RuntimeError(f"group {list(self.ranks)} carries collectives only; the plan names no channel from {peer}")

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.comm.all_reduce(tensor, self.device.current_stream())

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.comm.reduce_scatter(output, input, self.device.current_stream())

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        comm, side = self.comm, self.side
        assert side is not None  # a member always has its side stream
        _fork(self.device, side, (output, input))
        comm.reduce_scatter(output, input, side)
        return DeviceWork(self.device, side.record(), (output,))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.comm.all_gather(output, input, self.device.current_stream())

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> None:
        """Grouped sends and receives of rows (NCCL has no uneven all-to-all); this member's
        own rows are copied locally, empty pieces are not sent."""
        n = len(self.ranks)
        me = self.ranks.index(self.rank)
        ins = list(input_splits) if input_splits is not None else even_splits(input.shape[0], n)
        outs = list(output_splits) if output_splits is not None else even_splits(output.shape[0], n)
        stream = self.device.current_stream()
        in_at, out_at = split_offsets(ins), split_offsets(outs)
        with self.nccl.group():
            for j in range(n):
                if j == me:
                    continue
                if ins[j]:
                    self.comm.send(input.narrow(0, in_at[j], ins[j]), j, stream)
                if outs[j]:
                    self.comm.recv(output.narrow(0, out_at[j], outs[j]), j, stream)
        if ins[me]:
            output.narrow(0, out_at[me], outs[me]).copy_(input.narrow(0, in_at[me], ins[me]))

    def destroy(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None


class Channel:
    """One direction between two ranks: a two-rank NCCL communicator (sender is its rank 0)
    and this rank's stream for it."""

    def __init__(self, comm: NcclComm, peer: int, device: Device, stream: Stream) -> None:
        self.comm = comm
        self.peer = peer  # the other end, as the communicator's rank
        self.device = device
        self.stream = stream

    def send(self, tensor: torch.Tensor) -> Work:
        _fork(self.device, self.stream, (tensor,))
        self.comm.send(tensor, self.peer, self.stream)
        return DeviceWork(self.device, self.stream.record())

    def recv(self, tensor: torch.Tensor) -> Work:
        _fork(self.device, self.stream, (tensor,))
        self.comm.recv(tensor, self.peer, self.stream)
        return DeviceWork(self.device, self.stream.record(), (tensor,))


class NcclChannels:
    """The point-to-point traffic of one program communicator (module doc): a ``Channel`` or
    a host-staged two-rank ``Communicator`` per (sender, receiver) this rank is an end of."""

    def __init__(self, ranks: Sequence[int], rank: int, channels: Mapping[tuple[int, int], Channel | Communicator]) -> None:
        self.ranks = tuple(ranks)
        self.rank = rank
        self.channels = dict(channels)

    def _channel(self, src: int, dst: int) -> Channel | Communicator:
        try:
            return self.channels[(src, dst)]
        except KeyError:
            mine = sorted(self.channels)
            raise RuntimeError(
                f"rank {self.rank}: no channel {src} -> {dst} on this communicator (the program sends only on {mine})"
            ) from None

    def send(self, tensor: torch.Tensor, peer: int) -> Work:
        ch = self._channel(self.rank, peer)
        return ch.send(tensor) if isinstance(ch, Channel) else ch.send(tensor, peer)

    def recv(self, tensor: torch.Tensor, peer: int) -> Work:
        ch = self._channel(peer, self.rank)
        return ch.recv(tensor) if isinstance(ch, Channel) else ch.recv(tensor, peer)

    def _collective(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"communicator over {list(self.ranks)} carries point-to-point messages only")

    all_reduce = reduce_scatter = all_gather = all_to_all = _collective

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        raise RuntimeError(f"communicator over {list(self.ranks)} carries point-to-point messages only")

    def destroy(self) -> None:
        for ch in self.channels.values():
            if isinstance(ch, Channel):
                ch.comm.destroy()
        self.channels.clear()
