"""The executor: runs one rank's instruction list once, with a handler per instruction kind.

By default each logical stream runs on a lane of its own (``piper_runtime.rank.streams``, with the
backend's lanes and events), so communication proceeds while compute runs and the two chunks
of an overlapped slot run side by side. With ``threads=False`` (or when a collective
communicator is used by two lanes) it walks the list sequentially in one lane, where the
events are satisfied by construction.

Around every instruction: the ``before`` hook (posting receives ahead), the handler, then
the values it was the last reader of are dropped (``ReadCounts``) and, in a step that
accounts memory (opt-in: ``memory=True``), memory is sampled. This is the hot path: a few
microseconds per instruction (``benchmarks/bench_executor.py``).
A failure becomes an ``ExecutionError`` naming the rank, the instruction and the step, with
the worker's traceback. Each instruction's start and end go to a ``Progress`` record, which
the driver's watchdog reads while a step is in flight. The executor knows instruction kinds and the backend protocol only:
what each kind does is its handler's business, the hardware is the backend's.

``windows`` (``piper_runtime.rank.input_grads_first``): after the last instruction of each window
the executor calls ``settle``, inside that instruction; a profiled step times the window's
first ``B`` from its start to the end of the settling, so its time stays the whole pass's.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping

import torch

from piper_ir import ExecutionError, Instruction, NodeKind, RankPlan
from piper_runtime.backends.base import Streams
from piper_runtime.progress import Progress
from piper_runtime.rank.accounting import MemorySampler, keeps_model_state
from piper_runtime.rank.kernel_profile import LABEL
from piper_runtime.rank.state import ReadCounts, StepState
from piper_runtime.rank.streams import StreamLayout, run_streams
from piper_runtime.results import InstructionTiming

Handler = Callable[[Instruction, StepState], None]


class Executor:
    """Runs ``plan`` step after step (module doc)."""

    def __init__(
        self,
        plan: RankPlan,
        handlers: Mapping[NodeKind, Handler],
        *,
        before: Callable[[int, StepState], None],
        reads: ReadCounts,
        sampler: MemorySampler,  # after each instruction
        streams: Streams,
        threads: bool,
        timeout_s: float,
        progress: Progress | None = None,
        layout: StreamLayout | None = None,
        windows: Mapping[int, tuple[int, ...]] | None = None,
        settle: Callable[[StepState], None] = lambda st: None,
    ) -> None:
        self.plan = plan
        self.handlers = dict(handlers)
        self.before = before
        self.reads = reads
        self.sampler = sampler
        self.streams = streams
        self.threads = threads
        self.timeout_s = timeout_s
        self.progress = progress or Progress(plan.rank, plan.instructions)
        self.layout = (layout or StreamLayout(plan.instructions)) if threads else None  # the same every step
        self.windows = dict(windows or {})  # last instruction of a window -> its B's indices
        self.opening = frozenset(passes[0] for passes in self.windows.values())  # each window's first B
        self.settle = settle

    def run(
        self, st: StepState, step: int, started: float, profile: bool, memory: bool = True, labels: bool = False
    ) -> list[InstructionTiming]:
        """Run every instruction of the plan once; returns their timings with ``profile``
        (seconds from ``started``, a ``time.perf_counter`` value). ``memory``: sample memory
        after every instruction (the sampler's step must have begun ``active``). ``labels``:
        each instruction runs inside ``record_function("piper <id>")``, for torch.profiler's
        trace (piper_runtime.rank.kernel_profile)."""
        rank = self.plan.rank
        timings: list[InstructionTiming] = []
        instructions = self.plan.instructions
        # Looked up once per step, not once per instruction: this loop is the hot path.
        handlers = [self.handlers[ins.kind] for ins in instructions]
        before, release, sample = self.before, self.reads.release, self.sampler.sample
        perf_counter = time.perf_counter

        progress = self.progress
        started_at, finished = progress.started, progress.finished
        windows, opening, settle = self.windows, self.opening, self.settle
        opened: dict[int, float] = {}  # a window's first B -> its start, until the window settles

        def execute(k: int, ins: Instruction) -> None:
            t0 = perf_counter() if profile else 0.0
            started_at(k)
            closes = windows.get(k) if windows else None
            try:
                before(k, st)
                if labels:
                    with torch.profiler.record_function(f"{LABEL}{ins.id}"):
                        handlers[k](ins, st)
                else:
                    handlers[k](ins, st)
                if closes is not None:
                    t1 = perf_counter() if profile else 0.0
                    settle(st)
            except Exception as exc:
                raise self.error(f"instruction {ins.id} ({ins.short()})", exc, step, ins.id) from None
            if profile:
                if k in opening:
                    opened[k] = t0  # timed when its window settles
                elif closes is not None:
                    timings.append(InstructionTiming(rank, ins.id, t0 - started, t1 - started))
                    first = closes[0]
                    end = perf_counter() - started
                    timings.append(InstructionTiming(rank, instructions[first].id, opened.pop(first) - started, end))
                else:
                    timings.append(InstructionTiming(rank, ins.id, t0 - started, perf_counter() - started))
            release(k, st)
            if memory:
                sample(st, model_state=not keeps_model_state(ins))
            finished(k)

        progress.begin_step(step)
        try:
            if self.threads:
                run_streams(instructions, execute, timeout_s=self.timeout_s, streams=self.streams,
                            waiting=progress.waiting, layout=self.layout)
            else:
                with self.streams.lane(instructions[0].stream if instructions else "compute"):
                    for k, ins in enumerate(instructions):
                        execute(k, ins)
        finally:
            progress.end_step()
        return timings

    def error(self, where: str, exc: BaseException, step: int, node: str | None = None) -> ExecutionError:
        tb = "".join(traceback.format_exception(exc))
        rank = self.plan.rank
        return ExecutionError(
            f"rank {rank}, {where}: {type(exc).__name__}: {exc}\n{tb}",
            ranks=(rank,),
            nodes=(node,) if node else (),
            step=step,
        )
