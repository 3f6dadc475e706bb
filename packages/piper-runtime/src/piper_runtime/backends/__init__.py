"""Device backends behind one protocol (``base``): ``cpu`` (gloo, shared-memory channels between
ranks on one host in ``shm``, threads as streams), ``local`` (ranks as threads of one process, gloo
groups on loopback: ``local``) and ``cuda`` (cupy streams and events, NCCL
communicators; ``cuda``, ``device``, ``device_streams``, ``nccl``, ``staged``, ``gpu_plan``;
fakes for CPU tests in ``fakes``).
``register_backend(name, factory)`` adds one; the executor only talks to the protocol."""

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
    used_on_this_lane,
)
from piper_runtime.backends.cpu import CpuBackend, GlooCommunicator
from piper_runtime.backends.cuda import CudaBackend, cuda_backend, cuda_missing
from piper_runtime.backends.host import HostEvent, HostStreams


def local_backend() -> Backend:
    """The ``local`` backend (ranks as threads of one process: ``backends.local``), imported
    when first used."""
    from piper_runtime.backends.local import LocalBackend

    return LocalBackend()


register_backend("cpu", CpuBackend, replace=True)
register_backend("local", local_backend, replace=True)
register_backend("cuda", cuda_backend, replace=True)

__all__ = [
    "Backend",
    "BackendFactory",
    "Communicator",
    "CpuBackend",
    "CudaBackend",
    "Event",
    "GlooCommunicator",
    "HostEvent",
    "HostStreams",
    "Streams",
    "Work",
    "backend_factory",
    "backend_names",
    "cuda_missing",
    "register_backend",
    "resolve_backend",
    "unregister_backend",
    "used_on_this_lane",
]
