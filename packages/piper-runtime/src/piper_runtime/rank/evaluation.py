"""A forward-only step of the training program's world, over the same rank's parts.

An evaluation program (``piper_scheduler.forward_only`` of the training graph, compiled)
runs on the workers that train: the same modules, buckets (parameters a ZeRO-3 bucket keeps
sharded are gathered and freed as in training) and communicators, looked up by id, so
nothing new joins the world. It has its own executor, transport and read counts, and runs
with the modules in eval mode (dropout off), autograd off, and no memory accounting.
"""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

from piper_ir import BUCKET_KINDS, ExecutionError, NodeKind, Phase, Program
from piper_runtime.backends import Backend
from piper_runtime.rank.accounting import MemorySampler
from piper_runtime.rank.comms import Communicators
from piper_runtime.rank.compute import SegmentCompute
from piper_runtime.rank.data_parallel import DataParallel
from piper_runtime.rank.executor import Executor
from piper_runtime.rank.state import ReadCounts, StepState
from piper_runtime.rank.streams import lanes_share_a_communicator
from piper_runtime.rank.transport import Transport
from piper_runtime.results import StepOutput


class ForwardStep:
    """One rank's forward-only program (module doc)."""

    def __init__(
        self,
        program: Program,
        rank: int,
        modules: dict[str, nn.Module],
        comms: Communicators,
        dp: DataParallel,
        grads_lock: threading.RLock,
        sampler: MemorySampler,
        backend: Backend,
        threads: bool,
        timeout_s: float,
    ) -> None:
        plan = program.plan(rank)
        unknown = sorted({c.id for c in program.communicators} - set(comms.forward))
        if unknown or any(ins.phase is not Phase.F for ins in plan.instructions if ins.kind is NodeKind.COMPUTE):
            raise ExecutionError(
                f"rank {rank}: not a forward-only step of the training program "
                f"(communicators {unknown} unknown, or backward passes)",
                ranks=(rank,),
            )
        for ins in plan.instructions:
            if ins.kind in BUCKET_KINDS:
                dp.check(ins)
        self.program = program
        self.rank = rank
        self.modules = modules
        self.sampler = sampler
        self.transport = transport = Transport(program, plan, comms, backend.device)
        handlers = {
            NodeKind.COMPUTE: SegmentCompute(
                program, modules, grads_lock, dp.weight_pass, forward_only=True,
                replica=plan.replica, device=backend.device,
            ),
            NodeKind.SEND: transport.send,
            NodeKind.RECV: transport.recv,
            NodeKind.MARKER: lambda ins, st: None,
            NodeKind.MATERIALIZE: dp.materialize,
            NodeKind.FREE: dp.free,
        }
        self.reads = ReadCounts(program, plan.instructions)
        self.executor = Executor(
            plan, handlers, before=transport.post_recvs, reads=self.reads, sampler=sampler, streams=backend,
            threads=threads and not lanes_share_a_communicator(plan.instructions), timeout_s=timeout_s,
        )
        self.abandoned: StepState | None = None  # a failed step's state, its transfers kept referenced

    def run(
        self, chunks: dict[str, tuple[torch.Tensor, ...]], step: int,
        shapes: dict[int, dict[str, tuple[int, ...]]] | None = None,
    ) -> StepOutput:
        """Run the program once on the batch's microbatches (``shapes``: the transfers' shapes
        of a batch of other shapes, ``StepState.shape``); the losses this rank computed."""
        started = time.perf_counter()
        st = StepState(chunks, keep_grads=False, accounted=False, shapes=shapes)
        self.reads.start(st)
        self.sampler.begin(st, excluded=(), active=False)
        for module in self.modules.values():
            module.eval()
        try:
            self.executor.run(st, step, started, False, memory=False)
        except BaseException:
            # Destroying pending transfers could take the process down before the error
            # reaches the driver (which tears every rank down anyway).
            self.abandoned = st
            raise
        finally:
            self.sampler.end()
            for module in self.modules.values():
                module.train()
        try:
            self.transport.finish(st)
        except Exception as exc:
            raise self.executor.error("waiting for its sends to complete", exc, step) from None
        return StepOutput(self.rank, tuple(sorted(st.losses.items())), seconds=time.perf_counter() - started)
