"""The host side of streams: events that say "issued", lanes that need no device context.

On the CPU a lane's work is done when its instruction returns, so an event is only its host
side (a ``threading.Event``) and a lane's context is empty. A device backend reuses
``HostEvent`` for the host side of its events and adds the device side.
"""

from __future__ import annotations

import contextlib
import threading
from contextlib import AbstractContextManager


class HostEvent:
    """An ``Event`` with a host side only (``piper_runtime.backends.base.Event``)."""

    def __init__(self) -> None:
        self._issued = threading.Event()

    def record(self) -> None:
        self._issued.set()

    def wait_issued(self, timeout_s: float) -> bool:
        return self._issued.wait(timeout_s)

    def wait_device(self) -> None:
        """Nothing: the producer's work was complete when it recorded."""


class HostStreams:
    """``Streams`` for work that completes on the host: lanes are plain threads."""

    def event(self, name: str) -> HostEvent:
        return HostEvent()

    def lane(self, stream: str) -> AbstractContextManager[None]:
        return contextlib.nullcontext()
