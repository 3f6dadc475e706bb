"""``assemble``: one rank's parts, built and wired in order for ``RankWorker.setup``.

The parts, each doing one job:

- ``ties``: holders of a tied parameter on this rank share one tensor;
- ``sharding``: cut tensor/expert-parallel parameters to this rank's shard;
- ``data_parallel``: the bucket states of replicated segments (where each bucket's
  parameters, gradients and optimizer state live is in the program);
- ``optimizers``: one optimizer per stage segment, over what ``data_parallel`` says;
- ``comms``: the backend's communicators, per traffic class and direction, after joining the
  world; then tensor/expert-parallel modules are bound to theirs;
- ``compute`` (autograd), ``transport`` (send/receive), ``accounting`` (memory samples);
- ``executor``: runs the plan with a handler per instruction kind, threads per stream.

Everything that can be refused (an instruction kind this runtime does not run, a missing
module, a bucket that does not fit) is, before the rank joins the world.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping, Sequence

import attrs
from torch import nn

from piper_ir import BUCKET_KINDS, ExecutionError, Instruction, NodeKind, Program
from piper_runtime.backends import Backend
from piper_runtime.numerics import StateBackup
from piper_runtime.optim import OptimizerSpec
from piper_runtime.options import RankSetup
from piper_runtime.progress import Progress
from piper_runtime.rank.accounting import MemorySampler
from piper_runtime.rank.accumulation import accumulate_in_products, compiled_products
from piper_runtime.rank.comms import Communicators
from piper_runtime.rank.compiled import CompileStats
from piper_runtime.rank.compute import COMPUTE_PHASES, SegmentCompute
from piper_runtime.rank.data_parallel import DataParallel
from piper_runtime.rank.executor import Executor
from piper_runtime.rank.grad_norm import GradNorm
from piper_runtime.rank.input_grads_first import deferral_windows
from piper_runtime.rank.optimizers import Optimizers
from piper_runtime.rank.process import SWITCH_INTERVAL_S
from piper_runtime.rank.sharding import bind_collectives, cut_parameters, unbucketed_experts
from piper_runtime.rank.state import ReadCounts
from piper_runtime.rank.streams import StreamLayout, lanes_share_a_communicator
from piper_runtime.rank.ties import alias_tied
from piper_runtime.rank.transport import Transport

# Instruction kinds this runtime carries out; anything else is rejected at setup.
SUPPORTED = frozenset(
    {NodeKind.COMPUTE, NodeKind.OPTIMIZER, NodeKind.SEND, NodeKind.RECV, NodeKind.MARKER, NodeKind.GRAD_NORM}
    | BUCKET_KINDS
)


@attrs.define
class RankParts:
    """One rank's wired parts (module doc)."""

    modules: dict[str, nn.Module]
    data_parallel: DataParallel
    optimizers: Optimizers
    sampler: MemorySampler
    comms: Communicators
    transport: Transport
    reads: ReadCounts
    progress: Progress
    executor: Executor
    backup: StateBackup | None
    fused_layers: int  # ``nn.Linear`` layers summing gradients in their product (``accumulation``)
    compile_stats: CompileStats  # what compiling segments cost (``ExecutionOptions.compile``)


def assemble(
    rank: int,
    world: tuple[int, str, int],
    program: Program,
    modules: Mapping[str, nn.Module],
    optimizer: OptimizerSpec,
    backend: Backend,
    setup: RankSetup,
    grads_lock: threading.RLock,
) -> RankParts:
    """Build rank ``rank``'s parts for ``program`` and join the world ``(size, address, port)``
    through ``backend``; ``grads_lock``: the lock every reader and writer of ``.grad`` takes."""
    execution, wait_s = setup.execution, setup.wait_s
    plan = program.plan(rank)
    check_supported(rank, plan.instructions)
    mine = plan.segments()
    missing = [s for s in mine if s not in modules]
    if missing:
        raise ExecutionError(f"rank {rank}: no module for segments {missing}", ranks=(rank,))
    held = {s: modules[s].to(backend.device) for s in mine}
    alias_tied(program, held)
    cut_parameters(program, rank, held)
    dp = DataParallel(program, rank, held, unbucketed_experts(program, rank), grads_lock)
    # Under a precision, stage segments compute on cast copies: no weight to add into.
    min_bytes = execution.grad_fusion_min_bytes
    fused = 0 if min_bytes is None or program.precision is not None or execution.compile else accumulate_in_products(
        held, plan.instructions, skip=dp.sharded_grad_ids, min_bytes=min_bytes
    )
    optimizers = Optimizers(program, held, optimizer, dp, grads_lock)
    grad_norm = GradNorm(program, rank, held, dp, optimizers.gradients, grads_lock, backend.device)
    params = [p for m in held.values() for p in m.parameters()]
    backup = StateBackup(params + dp.shards(), list(optimizers.by_segment.values())) if setup.backup else None
    sampler = MemorySampler(backend.memory_tracker(rank), grads_lock, params, dp, optimizers)
    for ins in plan.instructions:  # before joining the world: fail fast
        if ins.kind in BUCKET_KINDS:
            dp.check(ins)

    size, address, port = world
    backend.connect(rank, size, address, port, wait_s)
    comms = Communicators(backend, program)  # every rank, in program order
    bind_collectives(program, rank, held, comms)
    dp.connect(comms, sampler.sample, sampler.sample_now)
    grad_norm.connect(comms)
    transport = Transport(program, plan, comms, backend.device)
    threaded = execution.threads and not lanes_share_a_communicator(plan.instructions)
    if threaded:
        # A thread woken by finished communication waits for the GIL at most this long
        # (Python's default is 5 ms, longer than many of our instructions).
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    compute = SegmentCompute(
        program, held, grads_lock, dp.weight_pass,
        seed=setup.seed, replica=plan.replica, device=backend.device, sample=sampler.sample_now,
        instructions=plan.instructions if execution.fuse_loss_backward else (), compile=execution.compile,
        fused_weights=compiled_products(held, min_bytes, dp.sharded_grad_ids) if execution.compile
        and min_bytes is not None and program.precision is None else (),
    )
    layout = StreamLayout(plan.instructions) if threaded else None
    windows = (
        deferral_windows(plan.instructions, compute.defers, compute.passes_with, layout)
        # Compiled, not where gradients live sharded: a deferred BW would reduce-scatter them
        # inside the window's last SEND, under the gradient lock (eager's fused layers skip them too).
        if execution.input_grads_first and (fused or (execution.compile and not dp.sharded_grad_ids)) else {}
    )
    compute.defer(plan.instructions, windows)
    handlers = {
        NodeKind.COMPUTE: compute,
        NodeKind.OPTIMIZER: optimizers,
        NodeKind.SEND: transport.send,
        NodeKind.RECV: transport.recv,
        NodeKind.MARKER: lambda ins, st: None,
        NodeKind.ALL_REDUCE: dp.all_reduce,
        NodeKind.REDUCE_SCATTER: dp.reduce_scatter,
        NodeKind.ALL_GATHER: dp.all_gather,
        NodeKind.MATERIALIZE: dp.materialize,
        NodeKind.FREE: dp.free,
        NodeKind.GRAD_NORM: grad_norm,
    }
    reads = ReadCounts(program, plan.instructions)
    progress = Progress(rank, plan.instructions)
    executor = Executor(
        plan, handlers, before=transport.post_recvs, reads=reads, sampler=sampler, streams=backend,
        threads=threaded, timeout_s=wait_s, progress=progress, layout=layout, windows=windows,
        settle=compute.settle,
    )
    return RankParts(
        held, dp, optimizers, sampler, comms, transport, reads, progress, executor, backup, fused, compute.compile_stats
    )


def check_supported(rank: int, instructions: Sequence[Instruction]) -> None:
    """Refuse an instruction this runtime does not carry out, naming it."""
    for ins in instructions:
        if ins.kind not in SUPPORTED or (ins.kind is NodeKind.COMPUTE and ins.phase not in COMPUTE_PHASES):
            raise ExecutionError(
                f"rank {rank}, instruction {ins.id} ({ins.short()}): "
                f"{ins.kind.value} {ins.phase or ''} is not supported by this runtime yet",
                ranks=(rank,),
                nodes=(ins.id,),
            )
