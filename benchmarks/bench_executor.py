"""The executor's own cost per instruction, on a plan of no-op computes.

Compiles a real 1F1B program (the ``mlp`` model, pp=2, 16 microbatches; rank 0 holds 65
instructions, rank 1 97) and runs each rank's plan with the real ``Executor``, ``Transport``
(receives posted ahead on a communicator whose transfers complete at once), ``ReadCounts``
and ``MemorySampler``, but handlers that do nothing: what is left is the bookkeeping around
every instruction (posting receives, events and lanes, dropping values, memory samples).
The sampler sees the parameters and AdamW-like state of the ``stack`` model's stage (what a
memory sample walks on a real rank).

Four variants in one run, interleaved over repetitions (median): memory sampled after every
instruction (the runtime's behaviour before accounting became opt-in, and what a step with
``memory=True`` still does) or not (the default), each with one thread per stream (the
default) and sequentially.

    .venv/bin/python benchmarks/bench_executor.py [--microbatches 16] [--repeats 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from piper_directives import build_schedule, capture
from piper_ir import NodeKind, Program
from piper_memory import plan_memory
from piper_runtime.backends.host import HostStreams
from piper_runtime.rank.accounting import MemorySampler
from piper_runtime.rank.executor import Executor
from piper_runtime.rank.memory import MemoryTracker
from piper_runtime.rank.state import ReadCounts, StepState
from piper_runtime.rank.transport import Transport
from piper_scheduler import compile_program
from piper_train.models import build_model


class _Done:
    def wait(self) -> None:
        pass


class _Instant:
    """A communicator whose transfers are complete when issued."""

    def send(self, t: torch.Tensor, peer: int) -> _Done:
        return _Done()

    def recv(self, t: torch.Tensor, peer: int) -> _Done:
        return _Done()


class _Comms(dict):
    def __missing__(self, key: str) -> _Instant:
        return _Instant()


class _NoDataParallel:
    gathered_ids: frozenset[int] = frozenset()

    def shards(self) -> list[torch.Tensor]:
        return []

    def gathered_buffers(self) -> list[torch.Tensor]:
        return []


class _AdamState:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.tensors = [torch.zeros_like(p) for p in params for _ in range(2)]

    def state_tensors(self) -> list[torch.Tensor]:
        return self.tensors


def program_of(schedule: str, microbatches: int) -> Program:
    spec = build_model("mlp", stages=2)
    captured = capture(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn)
    return compile_program(plan_memory(build_schedule(schedule, 2, microbatches, stages=2).apply(captured.graph)))


def executor(program: Program, rank: int, threads: bool, params: list[torch.nn.Parameter]) -> Executor:
    plan = program.plan(rank)
    transport = Transport(program, plan, _Comms(), torch.device("cpu"))
    handlers = {kind: (lambda ins, st: None) for kind in NodeKind}
    handlers[NodeKind.RECV] = transport.recv
    sampler = MemorySampler(MemoryTracker(rank), threading.RLock(), params, _NoDataParallel(), _AdamState(params))
    return Executor(
        plan, handlers, before=transport.post_recvs, reads=ReadCounts(program, plan.instructions),
        sampler=sampler, streams=HostStreams(), threads=threads, timeout_s=30.0,
    )


def one_step(ex: Executor, memory: bool) -> float:
    st = StepState({}, keep_grads=False, accounted=memory)
    ex.reads.start(st)
    ex.sampler.begin(st, excluded=(), active=memory)
    t0 = time.perf_counter()
    ex.run(st, 1, t0, False, memory)
    elapsed = time.perf_counter() - t0
    ex.sampler.end()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    program = program_of("1f1b", args.microbatches)
    stage = build_model("stack", stages=2).model.stage_modules(2)
    variants = [(memory, threads) for memory in (True, False) for threads in (True, False)]
    print(f"Executor bookkeeping per instruction, no-op computes, 1F1B pp=2, {args.microbatches} microbatches, "
          f"median of {args.repeats} interleaved runs; load average {os.getloadavg()[0]:.1f}")
    header = f"{'rank':>4} {'instructions':>12} " + " ".join(
        f"{('memory ' if m else 'no memory ') + ('threads' if t else 'sequential'):>24}" for m, t in variants
    ) + f" {'before/after (threads)':>23}"
    print(header + "\n" + "-" * len(header))
    for rank in range(program.world_size):
        params = list(stage[rank].parameters())
        runners = {v: executor(program, rank, v[1], params) for v in variants}
        times: dict[tuple[bool, bool], list[float]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v in variants:
                times[v].append(one_step(runners[v], v[0]))
        n = len(program.plan(rank).instructions)
        us = {v: statistics.median(ts) / n * 1e6 for v, ts in times.items()}
        cells = " ".join(f"{us[v]:>21.1f} us" for v in variants)
        print(f"{rank:>4} {n:>12} {cells} {us[(True, True)] / us[(False, True)]:>22.1f}x", flush=True)


if __name__ == "__main__":
    main()
