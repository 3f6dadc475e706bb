"""A second backend plugs into the runtime without editing it.

``ThreadBackend`` below is a complete ``piper_runtime.backends.Backend`` written here, outside
the runtime package: every rank is a thread of this process, communicators are the
in-memory mailboxes and collective rounds the runtime's test fakes provide
(``backends.fakes.MemoryCommunicator``), rendezvous is in memory, and no
``torch.distributed`` world exists at all (so any direct
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
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
import torch.distributed as dist

from piper_directives import Place, Shard, Split, Strategy, build_schedule, capture, shard_modules
from piper_ir import Program
from piper_memory import plan_memory
from piper_runtime import OptimizerSpec, RankSetup, RankWorker
from piper_runtime.backends import HostEvent, register_backend, unregister_backend
from piper_runtime.backends.fakes import MemoryCommunicator, MemoryWorld
from piper_runtime.batch import batch_reads, check_batch, replica_slice
from piper_runtime.driver.merge import merge_outputs, merge_parameters
from piper_runtime.rank.memory import MemoryTracker
from piper_runtime.rank.streams import StreamLayout
from piper_runtime.testing import on_every_rank
from piper_scheduler import compile_program
from piper_train.models import build_model
from piper_train.reference import ReferenceTrainer

TIMEOUT_S = 60.0
NAME = "threads-in-process"


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
        self.comms: list[MemoryCommunicator] = []
        self.seen: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def count(self, what: str) -> None:
        with self._lock:
            self.seen[what] += 1

    def connect(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> None:
        self.world = MemoryWorld.named((NAME, master_port))  # keyed apart from the CUDA fakes' worlds
        self.rank = rank

    def communicator(self, ranks: Sequence[int], channels: Sequence[tuple[int, int]] = ()) -> MemoryCommunicator:
        comm = MemoryCommunicator(self.world, len(self.comms), ranks, self.rank)
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


def _run(workload, strategy: Strategy, backend: str, steps: int = 2) -> tuple[Program, list[RankWorker]]:
    captured = capture(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn)
    graph, modules = shard_modules(strategy.apply(captured.graph), captured.modules)
    program = compile_program(plan_memory(graph))
    optimizer = OptimizerSpec("adamw", 1e-3)
    reference = ReferenceTrainer(workload.model, workload.loss_fn, optimizer, program.microbatches)
    workers = [RankWorker(own_process=False) for _ in range(program.world_size)]  # threads of this process
    port = next(_PORTS)

    def setup(rank: int) -> None:
        mine = {s: copy.deepcopy(modules[s]) for s in program.plan(rank).segments()}  # as Ray would ship
        workers[rank].setup(rank, program.world_size, "in-process", port, program, mine, optimizer, backend,
                            RankSetup(wait_s=TIMEOUT_S, seed=None))

    on_every_rank(program.world_size, setup)
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

        got = merge_outputs(on_every_rank(program.world_size, run_step), program, keep_grads=True)
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
    # Lanes linked by events (an event whose readers all follow its recorder on one thread
    # is satisfied by that order, and made for no step: ``StreamLayout``).
    if any(StreamLayout(plan.instructions).events for plan in program.ranks):
        assert sum(b.seen["recorded"] for b in backends) > 0
        assert sum(b.seen["device waits"] for b in backends) > 0
    else:
        assert sum(b.seen["events"] for b in backends) == 0
