"""Lanes and events on device streams: ``Streams`` (``piper_runtime.backends.base``) for a GPU.

- Each logical stream of a rank's plan is one device stream, made once and reused every
  step; a lane's host thread runs inside ``lane(stream)``, which makes it current (torch's
  kernels and NCCL calls queue on it).
- A lane *forks* from, and *joins* back into, the stream that was current on its thread
  when it entered (the default stream for lane threads): on entry the lane's stream waits
  for an event recorded there (so the batch the worker copied to the GPU is in place before
  any lane reads it), on exit that stream waits for the lane's work (so whatever the worker
  does after the step, reading gradients, the next step's copies, memory the step freed,
  comes after it). The worker's thread never blocks on the GPU for this.
- ``DeviceEvent``: ``record`` (on the producer's lane, after its instruction was issued)
  records a device event on the lane's stream, then sets the host side; ``wait_device`` (on
  the consumer's lane, after ``wait_issued``) makes the consumer's stream wait for it. The
  host never waits for device work here.
- Inside a lane, ``used_on_this_lane(t)`` (``piper_runtime.backends.base``) keeps ``t``'s
  memory for that lane's stream (``Device.keep``, i.e. ``record_stream``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from piper_runtime.backends.base import lane_hook
from piper_runtime.backends.device import Device, DeviceEvent, Stream


class LaneEvent:
    """An ``Event`` with a host side (issued) and a device side (a recorded device event)."""

    def __init__(self, device: Device, name: str) -> None:
        self.device = device
        self.name = name
        self._issued = threading.Event()
        self._event: DeviceEvent | None = None

    def record(self) -> None:
        self._event = self.device.current_stream().record()
        self._issued.set()

    def wait_issued(self, timeout_s: float) -> bool:
        return self._issued.wait(timeout_s)

    def wait_device(self) -> None:
        if self._event is None:
            raise RuntimeError(f"event {self.name!r} is waited for on the device before it was recorded")
        self.device.current_stream().wait(self._event)


class DeviceStreams:
    """``Streams`` on a ``Device``: one device stream per logical stream (module doc)."""

    def __init__(self, device: Device) -> None:
        self.gpu = device
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()

    def stream(self, name: str) -> Stream:
        """The device stream of logical stream ``name`` (made on first use)."""
        with self._lock:
            found = self._streams.get(name)
            if found is None:
                found = self._streams[name] = self.gpu.new_stream(name)
        return found

    def event(self, name: str) -> LaneEvent:
        return LaneEvent(self.gpu, name)

    @contextlib.contextmanager
    def lane(self, stream: str) -> Iterator[None]:
        s = self.stream(stream)
        entry = self.gpu.current_stream()
        s.wait(entry.record())  # fork: after what this thread queued before the step
        try:
            with self.gpu.using(s), lane_hook(lambda t: self.gpu.keep(t, s)):
                yield
        finally:
            entry.wait(s.record())  # join: this thread's stream continues after the lane
