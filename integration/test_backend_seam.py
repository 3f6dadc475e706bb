"""A second backend plugs into the runtime without editing it.

``ThreadBackend`` below is a complete ``piper_runtime.backends.Backend`` written here, outside
the runtime package: every rank is a thread of this process, communicators are mailboxes
and rendezvous in memory, and no ``torch.distributed`` world exists at all (so any direct
call of the executor into ``torch.distributed`` would fail). It is registered under a name,
``RankWorker``s set up with that name run compiled programs (no Ray), and the results match
single-device training: pipeline sends and receives with events between lanes (1F1B),
ZeRO-1 and ZeRO-3 buckets (reduce-scatter, all-gather, materialize/free, early
reduce-scatter from gradient hooks), tensor-parallel all-reduces and expert-parallel uneven
all-to-alls inside compute, DualPipeV's overlapped slots with ZeRO-2, DualPipe's mirrored
replicas with ZeRO-3 (mirror sums). The backend also sees the executor enter its lanes and
use its events.
"""

from __future__ import annotations

import copy
import itertools
import queue
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
import torch.distributed as dist

from piper_directives import Place, Shard, Split, Strategy, build_schedule, capture, shard_modules
from piper_ir import Program
from piper_memory import plan_memory
from piper_runtime import OptimizerSpec, RankWorker
from piper_runtime.backends import HostEvent, register_backend, unregister_backend
from piper_runtime.batch import batch_reads, check_batch, replica_slice
from piper_runtime.memory import MemoryTracker
from piper_runtime.merge import merge_outputs, merge_parameters
from piper_scheduler import compile_program
from piper_train.models import build_model
from piper_train.reference import ReferenceTrainer

TIMEOUT_S = 60.0
NAME = "threads-in-process"


class _Done:
    def wait(self) -> None:
        pass


class _Receive:
    def __init__(self, box: queue.Queue, into: torch.Tensor) -> None:
        self.box, self.into = box, into

    def wait(self) -> None:
        self.into.copy_(self.box.get(timeout=TIMEOUT_S))


class _Round:
    """One collective call of one communicator: every member's input, once all are in."""

    def __init__(self, members: int) -> None:
        self.inputs: dict[int, object] = {}
        self.complete = threading.Event()
        self.unread = members


class _World:
    """What the ranks of one in-process world share."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.boxes: dict[tuple[int, int, int], queue.Queue] = {}  # (communicator, src, dst)
        self.rounds: dict[tuple[int, int], _Round] = {}  # (communicator, call number)
        self.backends: dict[int, ThreadBackend] = {}

    def box(self, key: tuple[int, int, int]) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault(key, queue.Queue())


_WORLDS: dict[int, _World] = {}
_WORLDS_LOCK = threading.Lock()


class ThreadCommunicator:
    """A communicator between threads; collectives sum in rank order."""

    def __init__(self, world: _World, key: int, ranks: Sequence[int], rank: int) -> None:
        self.world, self.key, self.ranks, self.rank = world, key, tuple(ranks), rank
        self.calls = 0
        self.used: Counter[str] = Counter()

    def _exchange(self, value: object) -> dict[int, object]:
        world, key = self.world, (self.key, self.calls)
        self.calls += 1
        with world.lock:
            r = world.rounds.setdefault(key, _Round(len(self.ranks)))
            r.inputs[self.rank] = value
            if len(r.inputs) == len(self.ranks):
                r.complete.set()
        if not r.complete.wait(TIMEOUT_S):
            raise TimeoutError(f"collective {key} of ranks {self.ranks}: only {sorted(r.inputs)} arrived")
        with world.lock:
            r.unread -= 1
            if r.unread == 0:
                del world.rounds[key]
        return r.inputs

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        inputs = self._exchange(t.detach().clone())
        total = inputs[self.ranks[0]].clone()
        for r in self.ranks[1:]:
            total += inputs[r]
        return total

    def send(self, tensor: torch.Tensor, peer: int) -> _Done:
        self.used["send"] += 1
        self.world.box((self.key, self.rank, peer)).put(tensor.detach().clone())
        return _Done()

    def recv(self, tensor: torch.Tensor, peer: int) -> _Receive:
        self.used["recv"] += 1
        return _Receive(self.world.box((self.key, peer, self.rank)), tensor)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.used["all_reduce"] += 1
        tensor.copy_(self._sum(tensor))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.used["reduce_scatter"] += 1
        n = output.numel()
        output.copy_(self._sum(input).narrow(0, self.ranks.index(self.rank) * n, n))

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> _Done:
        self.reduce_scatter(output, input)  # complete when issued: every member issues it in turn
        return _Done()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.used["all_gather"] += 1
        inputs = self._exchange(input.detach().clone())
        output.copy_(torch.cat([inputs[r] for r in self.ranks]))

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> None:
        self.used["all_to_all"] += 1
        n = len(self.ranks)
        splits = list(input_splits) if input_splits is not None else [input.shape[0] // n] * n
        inputs = self._exchange((input.detach().clone(), splits))
        me = self.ranks.index(self.rank)
        pieces = [torch.split(inputs[r][0], inputs[r][1])[me] for r in self.ranks]
        output.copy_(torch.cat(pieces))


class _CountingEvent(HostEvent):
    def __init__(self, backend: ThreadBackend) -> None:
        super().__init__()
        self.backend = backend

    def record(self) -> None:
        self.backend.count("recorded")
        super().record()

    def wait_device(self) -> None:
        self.backend.count("device waits")


class ThreadBackend:
    """The whole ``Backend`` protocol, with ranks as threads of this process (module doc)."""

    name = NAME
    gpus_per_rank = 0.0

    def __init__(self) -> None:
        self.comms: list[ThreadCommunicator] = []
        self.seen: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def count(self, what: str) -> None:
        with self._lock:
            self.seen[what] += 1

    def connect(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> None:
        with _WORLDS_LOCK:
            self.world = _WORLDS.setdefault(master_port, _World(world_size))
        self.rank = rank
        self.world.backends[rank] = self

    def communicator(self, ranks: Sequence[int], channels: Sequence[tuple[int, int]] = ()) -> ThreadCommunicator:
        comm = ThreadCommunicator(self.world, len(self.comms), ranks, self.rank)
        self.comms.append(comm)
        return comm

    def event(self, name: str) -> _CountingEvent:
        self.count("events")
        return _CountingEvent(self)

    def lane(self, stream: str) -> AbstractContextManager[None]:
        @contextmanager
        def entered() -> Iterator[None]:
            self.count(f"lane {stream}")
            yield

        return entered()

    def memory_tracker(self, rank: int) -> MemoryTracker:
        return MemoryTracker(rank)

    def shutdown(self) -> None:
        pass


@pytest.fixture
def thread_backend() -> Iterator[str]:
    """``ThreadBackend`` registered; the process-wide settings a worker changes restored."""
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    register_backend(NAME, ThreadBackend)
    try:
        yield NAME
    finally:
        unregister_backend(NAME)
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)


_PORTS = itertools.count(1)  # world keys: nothing listens anywhere


def _on_every_rank(world_size: int, work: Callable[[int], object]) -> list[object]:
    """``work(rank)`` on one thread per rank; the results in rank order, or the first error."""
    results: list[object] = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    if errors:
        raise errors[0]
    return results


def _run(workload, strategy: Strategy, backend: str, steps: int = 2) -> tuple[Program, list[RankWorker]]:
    captured = capture(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn)
    graph, modules = shard_modules(strategy.apply(captured.graph), captured.modules)
    program = compile_program(plan_memory(graph))
    optimizer = OptimizerSpec("adamw", 1e-3)
    reference = ReferenceTrainer(workload.model, workload.loss_fn, optimizer, program.microbatches)
    workers = [RankWorker() for _ in range(program.world_size)]
    port = next(_PORTS)

    def setup(rank: int) -> None:
        mine = {s: copy.deepcopy(modules[s]) for s in program.plan(rank).segments()}  # as Ray would ship
        workers[rank].setup(rank, program.world_size, "in-process", port, program, mine, optimizer, backend, TIMEOUT_S)

    _on_every_rank(program.world_size, setup)
    for step in range(steps):
        inputs, targets = workload.batches(step)
        batch = check_batch(program, inputs, targets)

        def run_step(rank: int, batch=batch):
            replica = program.plan(rank).replica
            mine = {
                n: replica_slice(batch[n], program.value_by_name[n].meta, program.microbatches, program.replicas, replica)
                for n in batch_reads(program, rank)
            }
            return workers[rank].run_step(mine, keep_grads=True)

        got = merge_outputs(_on_every_rank(program.world_size, run_step), program, keep_grads=True)
        want = reference.step(inputs, targets)
        assert got.losses == pytest.approx(want.losses, rel=1e-9, abs=1e-12)
        assert set(got.grads) == set(want.grads)
        for name, g in want.grads.items():
            torch.testing.assert_close(got.grads[name], g, rtol=1e-9, atol=1e-12, msg=f"step {step} grad {name}")
    params = merge_parameters(program, [w.parameters() for w in workers], [w.parameter_shards() for w in workers])
    for name, p in reference.parameters().items():
        torch.testing.assert_close(params[name], p, rtol=1e-9, atol=1e-12, msg=f"parameter {name}")
    return program, workers


CASES = {
    "1f1b pp=2": ("mlp", 2, lambda: build_schedule("1f1b", 2, 4, stages=2), {"send", "recv"}),
    "gpipe dp=2 zero=1": ("mlp", 2, lambda: build_schedule("gpipe", 1, 2, stages=2, dp=2, zero=1),
                          {"reduce_scatter", "all_gather"}),
    "gpipe dp=2 zero=3": ("mlp", 2, lambda: build_schedule("gpipe", 1, 2, stages=2, dp=2, zero=3),
                          {"reduce_scatter", "all_gather"}),
    "tp=2": ("transformer", 1, lambda: Strategy([Split(2), Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1))]),
             {"all_reduce"}),
    "ep=2": ("moe", 1, lambda: Strategy([Split(2), Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1), kind="ep")]),
             {"all_to_all"}),
    "dualpipev pp=2 dp=2 zero=2": ("mlp", 4, lambda: build_schedule("dualpipev", 2, 4, stages=4, dp=2, zero=2),
                                   {"send", "recv", "reduce_scatter", "all_gather"}),
    "dualpipe pp=2 dp=2 zero=3": ("mlp", 2, lambda: build_schedule("dualpipe", 2, 4, dp=2, zero=3),
                                  {"send", "recv", "reduce_scatter", "all_gather", "all_reduce"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_backend_defined_outside_the_runtime_runs_compiled_programs(thread_backend: str, case: str) -> None:
    model, stages, strategy, operations = CASES[case]
    workload = build_model(model, stages=stages, seed=11, dtype=torch.float64)
    program, workers = _run(workload, strategy(), thread_backend)
    assert not dist.is_initialized()  # nothing went through torch.distributed
    backends = [w.backend for w in workers]
    assert all(isinstance(b, ThreadBackend) for b in backends)
    used = Counter()
    for b in backends:
        for comm in b.comms:
            used.update(comm.used)
    assert operations <= set(used), used
    streams = {ins.stream for plan in program.ranks for ins in plan.instructions}
    entered = {k.removeprefix("lane ") for b in backends for k in b.seen if k.startswith("lane ")}
    assert entered and entered <= streams
    assert all(w.threads for w in workers)  # one lane per stream
    if any(ins.waits for plan in program.ranks for ins in plan.instructions):  # lanes linked by events
        assert sum(b.seen["recorded"] for b in backends) > 0
        assert sum(b.seen["device waits"] for b in backends) > 0
