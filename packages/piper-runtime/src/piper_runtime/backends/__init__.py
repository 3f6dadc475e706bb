"""Device backends behind one protocol (``base``): ``cpu`` (gloo, threads as streams) and the
``cuda`` placeholder. ``register_backend(name, factory)`` adds one; the executor only talks
to the protocol."""

from piper_runtime.backends.base import (
    Backend,
    BackendFactory,
    Communicator,
    Event,
    Streams,
    Work,
    backend_factory,
    backend_names,
    register_backend,
    resolve_backend,
    unregister_backend,
)
from piper_runtime.backends.cpu import CpuBackend, GlooCommunicator
from piper_runtime.backends.cuda import cuda_backend
from piper_runtime.backends.host import HostEvent, HostStreams

register_backend("cpu", CpuBackend, replace=True)
register_backend("cuda", cuda_backend, replace=True)

__all__ = [
    "Backend",
    "BackendFactory",
    "Communicator",
    "CpuBackend",
    "Event",
    "GlooCommunicator",
    "HostEvent",
    "HostStreams",
    "Streams",
    "Work",
    "backend_factory",
    "backend_names",
    "register_backend",
    "resolve_backend",
    "unregister_backend",
]
