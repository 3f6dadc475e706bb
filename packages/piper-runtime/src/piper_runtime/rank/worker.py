"""``RankWorker``: the per-rank Ray actor, which wires the executor's parts for one rank.

``RankWorker`` is a plain class; the runtime wraps it with ``ray.remote`` (one actor per
rank). ``setup`` checks the plan, resolves the backend and builds, in this order, the
parts that each do one job:

- ``ties``: holders of a tied parameter on this rank share one tensor;
- ``sharding``: cut tensor/expert-parallel parameters to this rank's shard;
- ``data_parallel``: the bucket states of replicated segments (where each bucket's
  parameters, gradients and optimizer state live is in the program);
- ``optimizers``: one optimizer per stage segment, over what ``data_parallel`` says;
- ``comms``: the backend's communicators, per traffic class and direction, after joining the
  world; then tensor/expert-parallel modules are bound to theirs;
- ``compute`` (autograd), ``transport`` (send/receive), ``accounting`` (memory samples);
- ``executor``: runs the plan with a handler per instruction kind, threads per stream.

``run_step`` feeds one batch through the executor and returns the rank's ``StepOutput``
(``run_steps``: several, in one call).
``reset`` forgets the run, so a ``piper_runtime.driver.pool.WorkerPool`` can hand the actor to the
next runtime as if it had just started.

``load_forward`` adds a second, forward-only program of the same world (an evaluation step,
``piper_runtime.rank.evaluation``); ``run_forward`` runs it and returns the losses.

Parameter gradients are read or replaced only under one lock (``grads_lock``) that backward
passes, the optimizer, bucket operations and memory accounting take: autograd writes
``.grad`` without the GIL, so no other thread may read or replace one meanwhile.
Collectives run outside it.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch
from torch import nn

from piper_ir import BUCKET_KINDS, ExecutionError, NodeKind, Program
from piper_runtime.backends import Backend, BackendFactory, backend_factory
from piper_runtime.batch import from_wire, split_microbatches
from piper_runtime.numerics import StateBackup
from piper_runtime.optim import OptimizerSpec
from piper_runtime.progress import Progress, RankProgress
from piper_runtime.rank.accounting import MemorySampler
from piper_runtime.rank.accumulation import MIN_WEIGHT_BYTES, accumulate_in_products
from piper_runtime.rank.comms import Communicators
from piper_runtime.rank.compute import COMPUTE_PHASES, SegmentCompute
from piper_runtime.rank.cores import CoreClaim, bind_this_thread, claim, host_cores, thread_cores, unclaimed
from piper_runtime.rank.data_parallel import DataParallel
from piper_runtime.rank.evaluation import ForwardStep
from piper_runtime.rank.executor import Executor
from piper_runtime.rank.grad_norm import GradNorm
from piper_runtime.rank.input_grads_first import deferral_windows
from piper_runtime.rank.optimizers import Optimizers
from piper_runtime.rank.sharding import (
    bind_collectives,
    collective_seconds,
    cut_parameters,
    unbucketed_experts,
)
from piper_runtime.rank.state import ReadCounts, StepState
from piper_runtime.rank.streams import StreamLayout, lanes_share_a_communicator
from piper_runtime.rank.ties import alias_tied
from piper_runtime.rank.transport import Transport
from piper_runtime.rendezvous import open_listener
from piper_runtime.results import StepOutput

if TYPE_CHECKING:
    from piper_runtime.checkpoint import SaveSide

TORCH_THREADS = 1  # torch's intra-op threads per rank (ranks share the machine's cores)
SWITCH_INTERVAL_S = 0.0005  # the GIL hand-over interval with threads (Python's default: 5 ms)

# Instruction kinds this runtime carries out; anything else is rejected at setup.
SUPPORTED = frozenset(
    {NodeKind.COMPUTE, NodeKind.OPTIMIZER, NodeKind.SEND, NodeKind.RECV, NodeKind.MARKER, NodeKind.GRAD_NORM}
    | BUCKET_KINDS
)


class RankWorker:
    """Executes one rank of a ``Program``; used as a Ray actor by ``Runtime``."""

    def __init__(self) -> None:
        faulthandler.enable(all_threads=True)  # a crash in native code shows every thread
        if threading.current_thread() is threading.main_thread():
            # A SIGTERM to every process of a job (SLURM's scancel) is the driver's to act
            # on: it lets the steps sent finish and checkpoints the last (``piper train``),
            # then ends the workers itself; the reaper, or Ray, ends them when it is gone.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        torch.set_num_threads(TORCH_THREADS)
        self._fresh = _ProcessSettings.read()
        self._forget()
        # What the imports made lives as long as the process: the collector need not look at
        # it again (a full collection of torch's and Ray's objects costs 0.2 s; ``reset``).
        gc.freeze()

    def _forget(self) -> None:
        """The state of a worker that has not been set up."""
        self.rank = -1
        self.backend: Backend | None = None
        self._modules: dict[str, nn.Module] = {}
        self.fused_layers = 0  # ``nn.Linear`` layers summing gradients in their product (``accumulation``)
        self._grads_lock = threading.RLock()
        self._step = 0
        self._saving: SaveSide | None = None
        self._progress: Progress | None = None
        self._backup: StateBackup | None = None
        self._cores: tuple[int, ...] = ()  # what the thread that runs steps is bound to
        self._claim: CoreClaim | None = None  # this process's claim on those cores
        self._bound_thread: int | None = None

    def ping(self) -> int:
        return os.getpid()

    def host(self) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """This worker's host, as the machine's name and the cores it gives its workers (the
        ranks of one host share those: ``piper_runtime.rank.cores``); then the cores no other job
        claims now, and those it does."""
        cores = host_cores()
        free = unclaimed(cores)
        return (
            f"{socket.gethostname()}/{','.join(map(str, cores))}",
            free,
            tuple(c for c in cores if c not in free),
        )

    def cores(self) -> tuple[int, ...]:
        """The cores the thread that runs this worker's calls may use."""
        return thread_cores()

    def open_rendezvous(self, address: str) -> int:
        """On rank 0, before ``setup``: listen on ``address`` (this node's), on a port chosen
        here, kept for this process's TCP store (``piper_runtime.rendezvous``); the port."""
        return open_listener(address)

    def setup(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        program: Program,
        modules: Mapping[str, nn.Module],
        optimizer: OptimizerSpec,
        backend: str | BackendFactory = "cpu",
        timeout_s: float = 60.0,
        threads: bool = True,
        seed: int | None = None,
        backup: bool = False,
        fuse_loss_backward: bool = True,
        cores: Sequence[int] = (),
        grad_fusion_min_bytes: int | None = MIN_WEIGHT_BYTES,
        input_grads_first: bool = True,
    ) -> tuple[tuple[int, ...], int]:
        """Join the world, keep this rank's segment modules, build the optimizers.
        ``backend``: a registered name or a factory (``piper_runtime.backends``);
        ``timeout_s``: the bound on joining and on any one wait of a step (a receive, a
        collective, an event); ``threads``: one thread per stream (else one sequential walk
        of the plan); ``backup``: keep the state from before each step, for ``restore``;
        ``fuse_loss_backward``: run a loss's ``B`` together with its stage's where the plan
        allows (``piper_runtime.rank.compute``; off: each segment's time alone in a profile);
        ``grad_fusion_min_bytes``: ``nn.Linear`` weights of this many bytes or more sum
        their microbatches' gradients inside the matrix product (``piper_runtime.rank.accumulation``;
        ``None``: none do); ``input_grads_first``: a stage's last backward of the step
        posts the send of its input gradient before those layers add their weight products
        (``piper_runtime.rank.input_grads_first``; off: they add them during the pass);
        ``cores``: claim these and bind the thread that runs steps to them
        (``piper_runtime.rank.cores``; empty, or claimed by another job meanwhile: every core of
        the host); returns the cores it is bound to and how many layers the gradient fusion
        took. ``seed``:
        what every forward's random numbers are drawn from (``piper_runtime.rank.randomness``;
        ``Runtime`` always gives one). ``None`` leaves the process's generators as they are,
        with no lock: for a backend that runs several ranks in one process, whose forwards
        wait on each other inside collectives while a seeded forward holds the process's
        generators (a test backend; dropout then draws what it draws)."""
        self.rank = rank
        self.program = program
        plan = program.plan(rank)
        self.backend = (backend_factory(backend) if isinstance(backend, str) else backend)()
        _check_supported(rank, plan.instructions)
        mine = plan.segments()
        missing = [s for s in mine if s not in modules]
        if missing:
            raise ExecutionError(f"rank {rank}: no module for segments {missing}", ranks=(rank,))
        self._modules = {s: modules[s].to(self.backend.device) for s in mine}
        alias_tied(program, self._modules)
        cut_parameters(program, rank, self._modules)
        self._data_parallel = dp = DataParallel(
            program, rank, self._modules, unbucketed_experts(program, rank), self._grads_lock
        )
        # Under a precision, stage segments compute on cast copies: no weight to add into.
        fuse = grad_fusion_min_bytes is not None and program.precision is None
        self.fused_layers = 0 if not fuse else accumulate_in_products(
            self._modules, plan.instructions, skip=dp.sharded_grad_ids, min_bytes=grad_fusion_min_bytes
        )
        self._optimizers = optimizers = Optimizers(program, self._modules, optimizer, dp, self._grads_lock)
        grad_norm = GradNorm(
            program, rank, self._modules, dp, optimizers.gradients, self._grads_lock, self.backend.device
        )
        params = [p for m in self._modules.values() for p in m.parameters()]
        if backup:
            self._backup = StateBackup(params + dp.shards(), list(optimizers.by_segment.values()))
        self._sampler = MemorySampler(
            self.backend.memory_tracker(rank), self._grads_lock, params, dp, optimizers
        )
        for ins in plan.instructions:  # before joining the world: fail fast
            if ins.kind in BUCKET_KINDS:
                dp.check(ins)

        self.backend.connect(rank, world_size, master_addr, master_port, timeout_s)
        comms = Communicators(self.backend, program)  # every rank, in program order
        bind_collectives(program, rank, self._modules, comms)
        dp.connect(comms, self._sampler.sample, self._sampler.sample_now)
        grad_norm.connect(comms)
        self._comms, self._timeout_s = comms, timeout_s
        self._transport = transport = Transport(program, plan, comms, self.backend.device)
        threaded = threads and not lanes_share_a_communicator(plan.instructions)
        if threaded:
            # A thread woken by finished communication waits for the GIL at most this long
            # (Python's default is 5 ms, longer than many of our instructions).
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        compute = SegmentCompute(
            program, self._modules, self._grads_lock, dp.weight_pass,
            seed=seed, replica=plan.replica, device=self.backend.device, sample=self._sampler.sample_now,
            instructions=plan.instructions if fuse_loss_backward else (),
        )
        layout = StreamLayout(plan.instructions) if threaded else None
        windows = (
            deferral_windows(plan.instructions, compute.defers, compute.passes_with, layout)
            if input_grads_first and self.fused_layers else {}
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
        self._reads = ReadCounts(program, plan.instructions)
        self._progress = Progress(rank, plan.instructions)
        self._executor = Executor(
            plan,
            handlers,
            before=transport.post_recvs,
            reads=self._reads,
            sampler=self._sampler,
            streams=self.backend,
            threads=threaded,
            timeout_s=timeout_s,
            progress=self._progress,
            layout=layout,
            windows=windows,
            settle=compute.settle,
        )
        self._forward: ForwardStep | None = None
        # Last, so the threads made while joining the world (the communication library's)
        # keep the whole host; those the step thread starts from now on inherit its cores.
        self._unclaim()
        self._claim = claim(cores) if cores else None
        if self._claim is not None:
            self._bind(self._claim.cores)
        return self._cores, self.fused_layers

    def _bind(self, cores: tuple[int, ...]) -> None:
        """Bind the calling thread (the one that runs this worker's calls) to ``cores``
        (where the operating system lets it: ``cores()`` says what holds)."""
        bound = bind_this_thread(cores)
        self._cores = cores if bound else ()
        self._bound_thread = threading.get_ident()
        if not bound:
            self._unclaim()

    def _unclaim(self) -> None:
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def load_forward(self, program: Program) -> None:
        """Keep ``program``, a forward-only step of the same world, for ``run_forward``
        (``piper_runtime.rank.evaluation``)."""
        _check_supported(self.rank, program.plan(self.rank).instructions)
        self._forward = ForwardStep(
            program, self.rank, self._modules, self._comms, self._data_parallel, self._grads_lock, self._sampler,
            self.backend, self._executor.threads, self._timeout_s,
        )

    def run_forward(self, batch: Mapping[str, Any]) -> StepOutput:
        """Run the program of ``load_forward`` once on ``batch`` (as in ``run_step``), the
        modules in eval mode; returns the losses this rank computed."""
        if self._forward is None:
            raise ExecutionError(f"rank {self.rank}: no forward-only program loaded", ranks=(self.rank,))
        return self._forward.run(self._microbatches(self._forward.program, batch), self._step)

    def _microbatches(self, program: Program, batch: Mapping[str, Any]) -> dict[str, tuple[torch.Tensor, ...]]:
        """``batch`` (tensors or Ray object refs to them) on this rank's device, each split
        into the program's microbatches."""
        return {
            name: split_microbatches(
                _resolve(t).to(self.backend.device), program.value_by_name[name].meta, program.microbatches
            )
            for name, t in batch.items()
        }

    @property
    def threads(self) -> bool:
        """Whether steps run one thread per stream (else one sequential walk)."""
        return self._executor.threads

    def run_step(
        self,
        batch: Mapping[str, Any],
        keep_grads: bool = False,
        profile: bool = False,
        lr: float | None = None,
        memory: bool = False,
    ) -> StepOutput:
        """Run this rank's instructions once. ``batch`` maps the batch values this rank reads
        to whole-batch tensors (or Ray object refs to them); ``profile`` records when each
        instruction started and ended; ``lr`` is the learning rate of this step's updates
        (``None``: the one of the step before); ``memory`` accounts the rank's memory over
        the step (``StepOutput.memory``, else ``None``), at a cost per instruction."""
        self._step += 1
        if self._cores and self._bound_thread != threading.get_ident():
            self._bind(self._cores)  # Ray ran this call on another thread than setup
        if lr is not None:
            self._optimizers.set_lr(lr)
        started = time.perf_counter()
        if self._backup is not None:
            self._backup.save()
        chunks = self._microbatches(self.program, batch)
        st = StepState(chunks, keep_grads, step=self._step - 1, accounted=memory)
        self._reads.start(st)
        self._sampler.begin(st, excluded=[t for ts in chunks.values() for t in ts], active=memory)
        try:
            timings = self._executor.run(st, self._step, started, profile, memory)
        except BaseException:
            # Keep posted receives and unfinished sends referenced: destroying pending
            # transfers could take the process down before the error reaches the driver
            # (which tears every rank down anyway).
            self._abandoned = st
            raise
        finally:
            self._sampler.end()
        try:
            self._transport.finish(st)
        except Exception as exc:
            raise self._executor.error("waiting for its sends to complete", exc, self._step) from None
        return StepOutput(
            self.rank,
            tuple(sorted(st.losses.items())),
            st.grads if keep_grads else None,
            tuple(sorted(timings, key=lambda t: t.start)),
            time.perf_counter() - started,
            st.grad_shards if keep_grads else None,
            self._sampler.tracker.result() if memory else None,
            collective_seconds(self._modules),
            st.grad_norm,
            tuple(st.nonfinite),
            started,
        )

    def run_steps(self, steps: Sequence[tuple[Mapping[str, Any], bool, bool, float | None, bool]]) -> list[StepOutput]:
        """``run_step`` for each of ``steps`` (its arguments), in order: several steps in one
        call (``Runtime.submit_steps``). A step that raises ends the call."""
        return [self.run_step(*args) for args in steps]

    def restore(self) -> None:
        """Undo the last step: parameters and optimizer state as before it (``setup`` with
        ``backup``; ``piper_runtime.numerics``)."""
        if self._backup is None:
            raise ExecutionError(f"rank {self.rank}: restore without a backup (setup with backup=True)")
        with self._grads_lock:
            self._backup.restore()

    def progress(self) -> RankProgress | None:
        """What this rank is doing (``piper_runtime.progress``; ``None`` before ``setup``).
        The driver calls it on a concurrency group of its own (``MONITOR``), so it answers
        while a step runs."""
        return None if self._progress is None else self._progress.snapshot()

    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's current full parameters by qualified name (CPU copies); parameters
        that live only as shards between steps are in ``parameter_shards``."""
        sharded = self._data_parallel.gathered_ids
        return {
            qname: p.detach().to("cpu", copy=True)
            for module in self._modules.values()
            for qname, p in module.named_parameters()
            if id(p) not in sharded
        }

    def parameter_shards(self) -> dict[str, tuple[int, torch.Tensor]]:
        """``bucket id -> (replica, this replica's parameter shard)`` of the buckets whose
        parameters live sharded."""
        return self._data_parallel.parameter_shards()

    def checkpoint_plan(self, path: str, objects: Mapping[str, Any]) -> Any:
        """The first half of a save (``piper_runtime.checkpoint``): this rank's local plan
        for what it holds (and ``objects``, which the driver gives rank 0 only)."""
        # Imported on first use: a worker that never saves never imports safetensors.
        from piper_runtime.checkpoint import RankState, SaveSide

        state = RankState(self.program, self.rank, self._modules, self._data_parallel, self._optimizers)
        # This process's generators (what unseeded dropout draws from), under a key of its own.
        objects = {**objects, f"rng.rank{self.rank}": _rng_state(self.backend.device)}
        self._saving = SaveSide(path, self.rank, state.pieces(), objects)
        return self._saving.plan()

    def checkpoint_write(self, plan: Any) -> list[Any]:
        """The second half: write this rank's files by the driver's global ``plan``."""
        saving, self._saving = self._saving, None
        return saving.write(plan)

    def load_checkpoint(self, path: str, step: int, rng: bool = False) -> None:
        """Read this rank's parameters and optimizer state from the checkpoint at ``path``
        (written under any strategy); ``step``: the optimizer steps it had taken; ``rng``:
        also restore this rank's generators as that rank saved them (the same program only)."""
        from piper_runtime.checkpoint import RankState, read_objects  # on first use: checkpoint_plan's note

        RankState(self.program, self.rank, self._modules, self._data_parallel, self._optimizers).load(path, self.rank)
        self._step = step
        if rng:
            key = f"rng.rank{self.rank}"
            state = read_objects(path, [key])[key]
            torch.set_rng_state(state["torch"])
            if state.get("cuda") is not None:
                torch.cuda.set_rng_state(state["cuda"], self.backend.device)

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()

    def reset(self) -> int:
        """Forget the run, so the next ``setup`` starts as on a new actor: leave the world
        (the next one may have another size and port), drop the program, modules, optimizer
        and executor state, and put back the process-wide settings a run changes (the GIL
        switch interval, torch's thread count and default dtype) as this actor started
        with; torch's random generators are reseeded non-deterministically, as a new
        process's are. Only a run that ended cleanly is reset (``Runtime`` kills the actors
        of a failed one). Returns the process id."""
        self.shutdown()
        if self._cores:
            bind_this_thread(None)  # the next run decides anew
        self._unclaim()  # other jobs may have these cores now
        fresh = self._fresh
        self.__dict__.clear()
        self._fresh = fresh
        self._forget()
        fresh.restore()
        # The run's tensors and autograd graphs go now, not at some later step; what survives
        # (modules the run imported, caches) stays, and is not looked at again: a full
        # collection over everything took 0.22-0.25 s per reset, over the run's objects alone
        # a few ms.
        gc.collect()
        gc.freeze()
        return os.getpid()


@attrs.frozen
class _ProcessSettings:
    """Process-wide settings a run may change, as read when the actor started."""

    switch_interval: float
    threads: int
    dtype: torch.dtype

    @classmethod
    def read(cls) -> _ProcessSettings:
        return cls(sys.getswitchinterval(), torch.get_num_threads(), torch.get_default_dtype())

    def restore(self) -> None:
        sys.setswitchinterval(self.switch_interval)
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.seed()  # a new process's generators are seeded at random too


def _rng_state(device: torch.device) -> dict[str, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def _check_supported(rank: int, instructions: tuple) -> None:
    for ins in instructions:
        if ins.kind not in SUPPORTED or (ins.kind is NodeKind.COMPUTE and ins.phase not in COMPUTE_PHASES):
            raise ExecutionError(
                f"rank {rank}, instruction {ins.id} ({ins.short()}): "
                f"{ins.kind.value} {ins.phase or ''} is not supported by this runtime yet",
                ranks=(rank,),
                nodes=(ins.id,),
            )


def _resolve(value: Any) -> torch.Tensor:
    """The tensor the driver shipped (``batch.to_wire``), fetched from the Ray object store
    when given a reference."""
    if not isinstance(value, torch.Tensor | np.ndarray):
        import ray  # a reference: only when running under Ray

        value = ray.get(value, timeout=300)
    return from_wire(value)
