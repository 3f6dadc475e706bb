"""What the CUDA backend asks of the GPU, behind one small protocol (``Device``).

``CupyDevice`` is the real one: streams are cupy ``Stream``s (non-blocking, so they never
synchronise with the legacy default stream behind our back), which torch uses through
``torch.cuda.ExternalStream`` on the same handle; events are cupy ``Event``s recorded and
waited on the device (``cudaEventRecord`` / ``cudaStreamWaitEvent``), never on the host.
``keep`` is ``Tensor.record_stream``: the caching allocator will not hand the tensor's block
to anyone before the stream's work queued so far is done.

Everything above this module (lanes and events, communicators) is written against the
protocol, so it runs on CPU with ``piper_runtime.backends.fakes.FakeDevice``, whose log of
what was queued on which stream the tests check for ordering.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class DeviceEvent(Protocol):
    """A point in one stream's queue (a recorded CUDA event)."""


class Stream(Protocol):
    """A device stream."""

    name: str

    def record(self) -> DeviceEvent:
        """A new event marking the work queued on this stream so far."""
        ...

    def wait(self, event: DeviceEvent) -> None:
        """Work queued on this stream from now on starts after ``event`` (device side)."""
        ...


class Device(Protocol):
    """One GPU as the backend sees it (module doc)."""

    device: torch.device

    def new_stream(self, name: str) -> Stream:
        """A new stream (one per logical stream, per communicator side stream, per channel)."""
        ...

    def current_stream(self) -> Stream:
        """This thread's current stream (what torch and NCCL calls queue on)."""
        ...

    def using(self, stream: Stream) -> AbstractContextManager[None]:
        """Make ``stream`` (and this device) current on this thread, for torch and cupy."""
        ...

    def keep(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``tensor``'s memory is not reused before ``stream``'s work queued so far is done."""
        ...

    def synchronize(self) -> None:
        """Block the host until every stream's work is done."""
        ...

    def identity(self) -> str:
        """Which physical GPU this is, the same string in every process that uses it."""
        ...

    def reset_peak(self) -> None:
        """Start a new peak of the allocator's allocated bytes."""
        ...

    def peak_bytes(self) -> int:
        """The allocator's peak allocated bytes since ``reset_peak``."""
        ...


class CupyStream:
    """A cupy stream and the torch view of it (``torch.cuda.ExternalStream``)."""

    def __init__(self, name: str, cupy_stream: Any, torch_stream: torch.cuda.Stream) -> None:
        self.name = name
        self.cupy = cupy_stream
        self.torch = torch_stream

    @property
    def handle(self) -> int:
        """The ``cudaStream_t`` (what NCCL calls take)."""
        return int(self.cupy.ptr)

    def record(self) -> Any:
        import cupy

        event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
        event.record(self.cupy)
        return event

    def wait(self, event: Any) -> None:
        self.cupy.wait_event(event)


class CupyDevice:
    """The real ``Device``: cupy streams and events on GPU ``index`` (module doc)."""

    def __init__(self, index: int = 0) -> None:
        import cupy

        self._cupy = cupy
        self.index = index
        self.device = torch.device("cuda", index)
        self._wrapped: dict[int, CupyStream] = {}  # handle -> wrapper of streams we did not make
        self._lock = threading.Lock()
        torch.cuda.set_device(self.device)
        cupy.cuda.Device(index).use()

    def new_stream(self, name: str) -> CupyStream:
        with self._cupy.cuda.Device(self.index):
            s = self._cupy.cuda.Stream(non_blocking=True)
        stream = CupyStream(name, s, torch.cuda.ExternalStream(s.ptr, device=self.device))
        with self._lock:
            self._wrapped[stream.handle] = stream
        return stream

    def current_stream(self) -> CupyStream:
        ts = torch.cuda.current_stream(self.device)
        handle = int(ts.cuda_stream)
        with self._lock:
            found = self._wrapped.get(handle)
            if found is None:  # e.g. the default stream of a thread outside any lane
                found = CupyStream(f"stream@{handle:#x}", self._cupy.cuda.ExternalStream(handle), ts)
                self._wrapped[handle] = found
        return found

    @contextlib.contextmanager
    def using(self, stream: CupyStream) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(stream.torch), self._cupy.cuda.Device(self.index):
            with stream.cupy:
                yield

    def keep(self, tensor: torch.Tensor, stream: CupyStream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream.torch)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def identity(self) -> str:
        props = torch.cuda.get_device_properties(self.device)
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            return f"GPU-{uuid}"
        bus = getattr(props, "pci_bus_id", None)
        return f"{socket.gethostname()}/pci-{getattr(props, 'pci_domain_id', 0)}:{bus}:{getattr(props, 'pci_device_id', 0)}"

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))
