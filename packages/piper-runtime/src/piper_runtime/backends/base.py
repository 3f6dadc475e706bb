"""The backend protocol (everything the executor asks of the hardware) and the registry.

The executor never calls ``torch.distributed``, never names a device type and never creates
a thread-to-stream binding itself: it asks one ``Backend`` for

- the device tensors live on (``device``) and the Ray resources a rank needs
  (``gpus_per_rank``);
- logical streams and events. Each stream of a rank's plan runs on a *lane*, a host thread;
  ``lane(stream)`` is the context that thread runs in (CUDA: makes the stream current). An
  ``Event`` has a host side, "the producer lane has *issued* its work" (``record`` /
  ``wait_issued``), and a device side, ``wait_device``, called on the consumer's lane once the
  host side is satisfied (CUDA: the consumer's stream waits for a CUDA event recorded after
  the producer's work; CPU: work is done when issued, nothing more to wait for);
- communicators: after ``connect`` joins the world, ``communicator(ranks, channels)`` makes one
  group (every rank calls it for every group, member or not, in one order; ``channels`` are
  the (sender, receiver) pairs that will exchange point-to-point messages on it, so a backend
  can set up per-pair resources once, here). The executor makes one
  per program ``Communicator`` and direction, and one per device group of the early
  reduce-scatters (``piper_runtime.rank.comms``); tensor- and expert-parallel modules get theirs
  from there. A ``Communicator`` carries point-to-point sends and receives (asynchronous,
  ``Work`` handles) and the collectives: all-reduce, reduce-scatter (also started
  asynchronously), all-gather, all-to-all with uneven splits;
- memory accounting: ``memory_tracker(rank)`` is what counts the bytes of the tensors the
  worker holds (``piper_runtime.rank.memory``; a CUDA backend may add the allocator's figures).

Tensors that cross streams. A device backend whose lanes are separate device streams must
keep a tensor's memory from being reused while another stream's work on it is pending (CUDA:
``record_stream``). Communicators do that for what they touch; the few places where one lane
takes over model state another lane allocated (a gradient read and dropped by a bucket
instruction, gradients the optimizer frees) call ``used_on_this_lane(*tensors)``, which runs
the hook the current lane's context installed (``lane_hook``; nothing on the host).

Backends are found by name: ``register_backend(name, factory)``; ``resolve_backend(name)``
calls the factory. A factory returns an *unconnected* backend, which is cheap, so the driver
builds one to read its resource needs and to fail early where it cannot run; each worker
builds its own and connects it. Adding a backend means registering a factory: the executor
only talks to this protocol.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch

from piper_runtime.rank.memory import MemoryTracker


class Work(Protocol):
    """A pending asynchronous operation (a send, a receive, a started reduce-scatter)."""

    def wait(self) -> None:
        """Block until the operation is complete (its buffers may then be read or reused)."""
        ...


class Event(Protocol):
    """The link between the instruction that records it and those that wait for it."""

    def record(self) -> None:
        """On the producer's lane, once its instruction has been issued."""
        ...

    def wait_issued(self, timeout_s: float) -> bool:
        """Host side: whether the producer has recorded, waiting at most ``timeout_s``."""
        ...

    def wait_device(self) -> None:
        """Device side, on the consumer's lane after ``wait_issued``: order this lane's later
        work after the producer's (nothing on a backend whose work is done when issued)."""
        ...


class Streams(Protocol):
    """Lanes and events: what ``piper_runtime.rank.streams.run_streams`` needs of a backend."""

    def event(self, name: str) -> Event:
        """A new, unrecorded event."""
        ...

    def lane(self, stream: str) -> AbstractContextManager[None]:
        """The context a lane's host thread runs in while it executes ``stream``'s work."""
        ...


class Communicator(Protocol):
    """One group of ranks (``ranks``, global ranks in the program's order). Point-to-point
    messages between two ranks of one communicator are matched in issue order; every member
    issues the group's collectives in one order. Tensors are on the backend's device,
    contiguous; collectives sum."""

    ranks: tuple[int, ...]

    def send(self, tensor: torch.Tensor, peer: int) -> Work:
        """Start sending ``tensor`` to global rank ``peer`` (keep it alive until waited for)."""
        ...

    def recv(self, tensor: torch.Tensor, peer: int) -> Work:
        """Start receiving into ``tensor`` from global rank ``peer``."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place."""
        ...

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Sum ``input`` (the group's size times ``output``'s) over the group; member ``j``
        gets range ``j`` in ``output``."""
        ...

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """``reduce_scatter``, returning at once; ``output`` is valid after ``wait``."""
        ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Concatenate every member's ``input`` into ``output``, in group order."""
        ...

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> None:
        """Member ``i`` sends rows ``input_splits[j]`` (in order) to member ``j`` and receives
        ``output_splits[j]`` rows from it; ``None`` splits are even."""
        ...


class Backend(Streams, Protocol):
    """The hardware seam (module doc). ``name`` is the registered name."""

    name: str
    gpus_per_rank: float

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors live."""
        ...

    def connect(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> None:
        """Join the world (rank 0 listens on ``master_addr:master_port``)."""
        ...

    def communicator(self, ranks: Sequence[int], channels: Sequence[tuple[int, int]] = ()) -> Communicator:
        """A new group over ``ranks``; every rank of the world calls this for every group,
        in one order (a non-member gets an object it never uses). ``channels``: the
        ``(sender, receiver)`` pairs that will send point-to-point messages on it, in one
        order on every rank (empty: collectives only)."""
        ...

    def memory_tracker(self, rank: int) -> MemoryTracker:
        """What counts the bytes the worker holds (``piper_runtime.rank.memory``)."""
        ...

    def shutdown(self) -> None:
        """Leave the world; safe to call more than once, connected or not."""
        ...


BackendFactory = Callable[[], Backend]

_LANE = threading.local()


@contextmanager
def lane_hook(use: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Inside a lane's context: ``used_on_this_lane`` calls ``use`` on this thread."""
    previous = getattr(_LANE, "use", None)
    _LANE.use = use
    try:
        yield
    finally:
        _LANE.use = previous


def used_on_this_lane(*tensors: torch.Tensor | None) -> None:
    """The current lane reads (or takes over) ``tensors``, which another lane may have
    allocated: keep their memory from reuse until this lane's pending work on them is done
    (module doc). Nothing outside a device lane."""
    use = getattr(_LANE, "use", None)
    if use is not None:
        for t in tensors:
            if t is not None:
                use(t)

_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make ``factory`` (returning an unconnected ``Backend``; it may raise to say the backend
    cannot run here) the backend called ``name``."""
    if name in _REGISTRY and not replace:
        raise ValueError(f"a backend called {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = factory


def unregister_backend(name: str) -> None:
    """Forget the backend called ``name`` (tests register temporary ones)."""
    _REGISTRY.pop(name, None)


def backend_factory(name: str) -> BackendFactory:
    """The factory registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_REGISTRY)}") from None


def resolve_backend(name: str) -> Backend:
    """A new, unconnected backend called ``name``; raises for unknown names and for a
    backend that cannot run here."""
    return backend_factory(name)()


def backend_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))
