"""Fakes that run the CUDA backend's code on CPU, for tests (no GPU, no cupy, no NCCL).

- ``FakeDevice``: a ``Device`` whose tensors are on the CPU and whose streams keep a log of
  what was queued on them (kernels the test names, event records and waits, ``keep``s, NCCL
  calls), in issue order. ``happens_before(a, b)`` reads the log as a GPU would: work on one
  stream runs in order, a wait orders everything after it on its stream after the event's
  point on the recording stream, nothing else is ordered. So a test can prove that a
  consumer's kernel cannot run before its producer's on any GPU schedule, and that a broken
  variant (no device-side wait) is caught.
- Execution is eager, as on the host, except NCCL receives: those are queued on their stream
  and run when someone waits for an event recorded after them (or at ``synchronize``), so a
  receive can be posted long before its message exists, as on a GPU.
- ``MemoryWorld``: ranks as threads of one process. It is the host world a ``CudaBackend``
  joins (store and host groups, ``MemoryHost``) and the fabric ``FakeNccl`` communicators use.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

TIMEOUT_S = 60.0


# -- ranks as threads ------------------------------------------------------------------------------


class _Round:
    def __init__(self, members: int) -> None:
        self.inputs: dict[int, Any] = {}
        self.complete = threading.Event()
        self.unread = members


class MemoryWorld:
    """What the ranks (threads) of one in-process world share: a store, mailboxes per
    (communicator, sender, receiver), and collective rounds per (communicator, call)."""

    _worlds: dict[Any, MemoryWorld] = {}
    _worlds_lock = threading.Lock()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.store: dict[str, str] = {}
        self.boxes: dict[tuple[Any, int, int], queue.Queue] = {}
        self.rounds: dict[tuple[Any, int], _Round] = {}

    @classmethod
    def named(cls, key: Any) -> MemoryWorld:
        with cls._worlds_lock:
            return cls._worlds.setdefault(key, cls())

    @classmethod
    def join(cls, rank: int, world_size: int, address: str, port: int, timeout_s: float) -> MemoryHost:
        """``JoinHost`` for ``CudaBackend``: the world keyed by ``port``."""
        return MemoryHost(cls.named(port), rank)

    def box(self, key: tuple[Any, int, int]) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault(key, queue.Queue())

    def exchange(self, key: tuple[Any, int], members: int, rank: int, value: Any) -> dict[int, Any]:
        """Every member's ``value`` for one collective call, once all have arrived."""
        with self.lock:
            r = self.rounds.setdefault(key, _Round(members))
            r.inputs[rank] = value
            if len(r.inputs) == members:
                r.complete.set()
        if not r.complete.wait(TIMEOUT_S):
            raise TimeoutError(f"collective {key}: only ranks {sorted(r.inputs)} arrived")
        with self.lock:
            r.unread -= 1
            if r.unread == 0:
                del self.rounds[key]
        return r.inputs


class _Done:
    def wait(self) -> None:
        pass


class _Receive:
    def __init__(self, box: queue.Queue, into: torch.Tensor) -> None:
        self.box, self.into = box, into

    def wait(self) -> None:
        self.into.copy_(self.box.get(timeout=TIMEOUT_S))


class MemoryCommunicator:
    """A ``Communicator`` among threads on host tensors; collectives sum in group order."""

    def __init__(self, world: MemoryWorld, key: Any, ranks: Sequence[int], rank: int) -> None:
        self.world, self.key, self.ranks, self.rank = world, key, tuple(ranks), rank
        self.calls = 0
        self.used: dict[str, int] = {}

    def _count(self, what: str) -> None:
        self.used[what] = self.used.get(what, 0) + 1

    def _exchange(self, value: Any) -> dict[int, Any]:
        key = (self.key, self.calls)
        self.calls += 1
        return self.world.exchange(key, len(self.ranks), self.rank, value)

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        inputs = self._exchange(t.detach().clone())
        total = inputs[self.ranks[0]].clone()
        for r in self.ranks[1:]:
            total += inputs[r]
        return total

    def send(self, tensor: torch.Tensor, peer: int) -> _Done:
        self._count("send")
        self.world.box((self.key, self.rank, peer)).put(tensor.detach().clone())
        return _Done()

    def recv(self, tensor: torch.Tensor, peer: int) -> _Receive:
        self._count("recv")
        return _Receive(self.world.box((self.key, peer, self.rank)), tensor)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._count("all_reduce")
        tensor.copy_(self._sum(tensor))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._count("reduce_scatter")
        n = output.numel()
        output.copy_(self._sum(input).narrow(0, self.ranks.index(self.rank) * n, n))

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> _Done:
        self.reduce_scatter(output, input)
        return _Done()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._count("all_gather")
        inputs = self._exchange(input.detach().clone())
        output.copy_(torch.cat([inputs[r] for r in self.ranks]))

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> None:
        self._count("all_to_all")
        n = len(self.ranks)
        splits = list(input_splits) if input_splits is not None else [input.shape[0] // n] * n
        inputs = self._exchange((input.detach().clone(), splits))
        me = self.ranks.index(self.rank)
        output.copy_(torch.cat([torch.split(inputs[r][0], inputs[r][1])[me] for r in self.ranks]))


class MemoryHost:
    """``HostWorld`` (``piper_runtime.backends.cuda``) of one rank of a ``MemoryWorld``."""

    def __init__(self, world: MemoryWorld, rank: int) -> None:
        self.world, self.rank = world, rank
        self.groups = 0
        self.made: list[MemoryCommunicator] = []

    def set(self, key: str, value: str) -> None:
        with self.world.changed:
            self.world.store[key] = value
            self.world.changed.notify_all()

    def get(self, key: str) -> str:
        with self.world.changed:
            if not self.world.changed.wait_for(lambda: key in self.world.store, TIMEOUT_S):
                raise TimeoutError(f"store key {key!r} was never set")
            return self.world.store[key]

    def communicator(self, ranks: Sequence[int]) -> MemoryCommunicator:
        self.groups += 1
        comm = MemoryCommunicator(self.world, ("host", self.groups), ranks, self.rank)
        self.made.append(comm)
        return comm

    def shutdown(self) -> None:
        pass


# -- a device that logs ------------------------------------------------------------------------------


class FakeEvent:
    _ids = itertools.count()

    def __init__(self, stream: FakeStream, position: int) -> None:
        self.id = next(self._ids)
        self.stream, self.position = stream, position


class FakeStream:
    """A stream of a ``FakeDevice``: a log of queued work, lazy NCCL receives (module doc)."""

    def __init__(self, device: FakeDevice, name: str) -> None:
        self.device, self.name = device, name
        self.queued = 0  # entries queued so far
        self._lazy: list[tuple[int, Callable[[], None]]] = []  # (position, work) not run yet
        self._lock = threading.RLock()

    def enqueue(self, what: tuple, work: Callable[[], None] | None = None, lazy: bool = False) -> None:
        with self._lock:
            self.device.log_entry(self, what)
            position = self.queued
            self.queued += 1
            if work is not None:
                if lazy:
                    self._lazy.append((position, work))
                else:
                    work()

    def record(self) -> FakeEvent:
        with self._lock:
            event = FakeEvent(self, self.queued + 1)
            self.enqueue(("record", event.id))
        return event

    def wait(self, event: FakeEvent) -> None:
        self.enqueue(("wait", event.id))
        event.stream.flush(event.position)

    def flush(self, upto: int | None = None) -> None:
        """Run the lazy work queued before ``upto`` (everything when ``None``)."""
        with self._lock:
            while self._lazy and (upto is None or self._lazy[0][0] < upto):
                _, work = self._lazy.pop(0)
                work()


class FakeDevice:
    """A ``Device`` on the CPU that logs what each stream was asked to do (module doc)."""

    def __init__(self, identity: str = "fake-gpu-0") -> None:
        self.device = torch.device("cpu")
        self._identity = identity
        self.log: list[tuple[str, tuple]] = []  # (stream name, what), in issue order
        self._log_lock = threading.Lock()
        self._local = threading.local()
        self.streams: dict[str, FakeStream] = {}
        self.default = self.new_stream("default")
        self.peak = 0

    def log_entry(self, stream: FakeStream, what: tuple) -> None:
        with self._log_lock:
            self.log.append((stream.name, what))

    def new_stream(self, name: str) -> FakeStream:
        base, n = name, 1
        while name in self.streams:  # names are unique, so the log can be read by name
            n += 1
            name = f"{base}#{n}"
        stream = self.streams[name] = FakeStream(self, name)
        return stream

    def current_stream(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self.default

    @contextlib.contextmanager
    def using(self, stream: FakeStream) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def keep(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        stream.enqueue(("keep", _tensor_label(tensor)))

    def kernel(self, label: str, work: Callable[[], None] | None = None) -> None:
        """Log (and run) a kernel named ``label`` on the current stream."""
        self.current_stream().enqueue(("kernel", label), work)

    def synchronize(self) -> None:
        for stream in list(self.streams.values()):
            stream.flush()

    def identity(self) -> str:
        return self._identity

    def reset_peak(self) -> None:
        self.peak = 0

    def peak_bytes(self) -> int:
        return self.peak

    # -- reading the log ---------------------------------------------------------------------------

    def entries(self, kind: str) -> list[tuple[str, tuple]]:
        return [(s, what) for s, what in self.log if what[0] == kind]

    def happens_before(self, first: tuple, second: tuple) -> bool:
        """Whether the logged entry ``first`` runs before ``second`` on every GPU schedule:
        ``second`` is reachable from ``first`` through stream order and record -> wait."""
        log = list(self.log)
        index = {}
        for i, (_, what) in enumerate(log):
            index.setdefault(what, i)
        if first not in index or second not in index:
            raise KeyError(f"not in the log: {first if first not in index else second}")
        recorded_at = {what[1]: i for i, (_, what) in enumerate(log) if what[0] == "record"}
        successors: dict[int, list[int]] = {}
        last_on: dict[str, int] = {}
        for i, (stream, what) in enumerate(log):
            if stream in last_on:
                successors.setdefault(last_on[stream], []).append(i)
            last_on[stream] = i
            if what[0] == "wait":
                successors.setdefault(recorded_at[what[1]], []).append(i)
        seen, todo = set(), [index[first]]
        while todo:
            i = todo.pop()
            if i == index[second]:
                return True
            for j in successors.get(i, ()):
                if j not in seen:
                    seen.add(j)
                    todo.append(j)
        return False


def _tensor_label(t: torch.Tensor) -> str:
    return f"tensor@{t.untyped_storage().data_ptr():#x}" if t.untyped_storage().nbytes() else "tensor@empty"


# -- NCCL among threads ---------------------------------------------------------------------------------


class FakeNcclComm:
    """``NcclComm`` among threads: collectives and sends at once, receives when waited for."""

    def __init__(self, library: FakeNccl, key: str, size: int, rank: int) -> None:
        self.library = library
        self.host = MemoryCommunicator(library.world, ("nccl", key), range(size), rank)
        self.rank = rank
        self.destroyed = False

    def send(self, tensor: torch.Tensor, peer: int, stream: FakeStream) -> None:
        stream.enqueue(("nccl.send", self.host.key, self.rank, peer), lambda: self.host.send(tensor, peer))

    def recv(self, tensor: torch.Tensor, peer: int, stream: FakeStream) -> None:
        work = self.host.recv(tensor, peer)
        stream.enqueue(("nccl.recv", self.host.key, peer, self.rank), work.wait, lazy=True)
        self.library.touched(stream)

    def all_reduce(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        stream.enqueue(("nccl.all_reduce", self.host.key, self.host.calls), lambda: self.host.all_reduce(tensor))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, stream: FakeStream) -> None:
        stream.enqueue(
            ("nccl.reduce_scatter", self.host.key, self.host.calls), lambda: self.host.reduce_scatter(output, input)
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, stream: FakeStream) -> None:
        stream.enqueue(("nccl.all_gather", self.host.key, self.host.calls), lambda: self.host.all_gather(output, input))

    def destroy(self) -> None:
        self.destroyed = True


class FakeNccl:
    """``NcclLibrary`` among the threads of ``world``."""

    def __init__(self, world: MemoryWorld) -> None:
        self.world = world
        self.made: list[FakeNcclComm] = []
        self.groups = 0
        self._local = threading.local()

    def unique_id(self) -> list[int]:
        return list(uuid.uuid4().bytes)

    def communicator(self, size: int, unique_id: Sequence[int], rank: int) -> FakeNcclComm:
        comm = FakeNcclComm(self, bytes(unique_id).hex(), size, rank)
        self.made.append(comm)
        return comm

    def touched(self, stream: FakeStream) -> None:
        streams = getattr(self._local, "group", None)
        if streams is not None:
            streams.append(stream)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Sends happen at once and receives are queued, so any order inside works; at the
        end the receives queued inside run (as the group's kernel would, before the next work
        on its stream, which the host runs at once here)."""
        self.groups += 1
        self._local.group = streams = []
        try:
            yield
        finally:
            self._local.group = None
        for stream in streams:
            stream.flush()
