"""``RankWorker``: one rank of a run, behind the calls the driver makes.

A plain class: the ``ray`` runtime wraps it with ``ray.remote`` (one actor per rank), the
``local`` runtime calls it on threads of its own, the ``torchrun`` runtime in the launched
process. ``setup`` builds the rank's parts (``piper_runtime.rank.assembly``) and joins the
world; ``run_step`` feeds one batch through the executor and returns the rank's
``StepOutput`` (``run_steps``: several, in one call); ``load_forward``/``run_forward`` add and
run a forward-only program of the same world (``piper_runtime.rank.evaluation``);
``checkpoint_plan``/``checkpoint_write``/``load_checkpoint`` save and read what the rank
holds (``piper_runtime.checkpoint``). ``reset`` forgets the run, so a
``piper_runtime.driver.pool.WorkerPool`` can hand the actor to the next runtime as if it had
just started.

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
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from piper_ir import ExecutionError, Program
from piper_runtime.backends import Backend, BackendFactory, backend_factory
from piper_runtime.batch import received_microbatches
from piper_runtime.numerics import StateBackup
from piper_runtime.optim import OptimizerSpec
from piper_runtime.options import RankSetup
from piper_runtime.progress import Progress, RankProgress
from piper_runtime.rank.assembly import assemble, check_supported
from piper_runtime.rank.cores import StepCores, host_report, thread_cores
from piper_runtime.rank.evaluation import ForwardStep
from piper_runtime.rank.kernel_profile import kernel_trace
from piper_runtime.rank.memory_snapshot import cuda_history
from piper_runtime.rank.process import TORCH_THREADS, ProcessSettings, rng_state, set_rng_state
from piper_runtime.rank.sharding import collective_seconds
from piper_runtime.rank.state import StepState
from piper_runtime.rendezvous import open_listener
from piper_runtime.results import RankLayout, RankStep, StepOutput

if TYPE_CHECKING:
    from piper_runtime.checkpoint import SaveSide

__all__ = ["TORCH_THREADS", "RankWorker"]


class RankWorker:
    """Executes one rank of a ``Program``; used as a Ray actor by ``Runtime``."""

    def __init__(self, own_process: bool = True) -> None:
        """``own_process``: the worker has a process to itself (a Ray actor, a launched rank)
        and sets it up: crash dumps of every thread, SIGTERM left to the driver, torch's
        threads, the collector. A rank of the ``local`` runtime shares the user's process and
        leaves those alone."""
        self._fresh = ProcessSettings.read()
        self._own_process = own_process  # else every rank of the program is a thread of this process
        if own_process:
            faulthandler.enable(all_threads=True)  # a crash in native code shows every thread
            if threading.current_thread() is threading.main_thread():
                # A SIGTERM to every process of a job (SLURM's scancel) is the driver's to act
                # on: it lets the steps sent finish and checkpoints the last (``piper train``),
                # then ends the workers itself; the reaper, or Ray, ends them when it is gone.
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            torch.set_num_threads(TORCH_THREADS)
            self._fresh = ProcessSettings.read()
        self._forget()
        if own_process:
            # What the imports made lives as long as the process: the collector need not look
            # at it again (a full collection of torch's and Ray's objects costs 0.2 s; ``reset``).
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
        self._cores = StepCores()  # what the thread that runs steps is bound to
        # Shape tables of batches of other shapes than the program's (``add_shapes``): by key,
        # the shape of each transfer whose shape differs, by instruction id.
        self._shapes: dict[str, dict[str, tuple[int, ...]]] = {}

    def ping(self) -> int:
        return os.getpid()

    def warm(self) -> None:
        """Import now what this rank's first step would: an optimizer step imports torch's
        compiler stack (``torch._dynamo``, sympy; about 800 modules, a second or two of CPU).
        Called on workers started before their program exists (``early_workers``); touches
        no random generator and keeps nothing."""
        p = nn.Parameter(torch.zeros(2))
        p.grad = torch.zeros(2)
        torch.optim.AdamW([p]).step()

    def host(self) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """``piper_runtime.rank.cores.host_report``: this host, its free and claimed cores."""
        return host_report()

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
        setup: RankSetup | None = None,
    ) -> tuple[tuple[int, ...], int]:
        """Join the world, keep this rank's segment modules, build the optimizers.
        ``backend``: a registered name or a factory (``piper_runtime.backends``); ``setup``:
        the run's options for this rank (``piper_runtime.options.RankSetup``: how the plan is
        walked, the bound on every wait, the seed, the backup for undoing a step, the cores to
        bind to). Returns the cores the step thread is bound to and how many layers the
        gradient fusion took (``piper_runtime.rank.accumulation``)."""
        setup = setup or RankSetup()
        self.rank = rank
        self.program = program
        self.backend = (backend_factory(backend) if isinstance(backend, str) else backend)()
        parts = assemble(
            rank, (world_size, master_addr, master_port), program, modules, optimizer, self.backend, setup,
            self._grads_lock,
        )
        self._modules, self._data_parallel, self._optimizers = parts.modules, parts.data_parallel, parts.optimizers
        self._sampler, self._comms, self._transport = parts.sampler, parts.comms, parts.transport
        self._reads, self._progress, self._executor = parts.reads, parts.progress, parts.executor
        self._backup, self.fused_layers, self._timeout_s = parts.backup, parts.fused_layers, setup.wait_s
        self._compile_stats = parts.compile_stats
        self._profile_kernels = setup.execution.profile_kernels
        self._memory_snapshot = setup.execution.memory_snapshot
        self._forward: ForwardStep | None = None
        # Last, so the threads made while joining the world (the communication library's)
        # keep the whole host; those the step thread starts from now on inherit its cores.
        self._cores.take(setup.cores)
        return self._cores.cores, self.fused_layers

    def load_forward(self, program: Program) -> None:
        """Keep ``program``, a forward-only step of the same world, for ``run_forward``
        (``piper_runtime.rank.evaluation``)."""
        check_supported(self.rank, program.plan(self.rank).instructions)
        self._forward = ForwardStep(
            program, self.rank, self._modules, self._comms, self._data_parallel, self._grads_lock, self._sampler,
            self.backend, self._executor.threads, self._timeout_s,
        )

    def add_shapes(self, key: str, shapes: Mapping[str, Sequence[int]]) -> None:
        """Keep ``shapes`` (instruction id -> the shape its transfer has) under ``key``: the
        program's transfers for a batch of other shapes (``Runtime.add_variant``). A step
        whose ``RankLayout`` names ``key`` for a microbatch sends and receives those shapes;
        the modules, parameters, optimizer state and everything else are shared."""
        self._shapes[key] = {ins: tuple(shape) for ins, shape in shapes.items()}

    def run_forward(self, batch: Mapping[str, Any], layout: RankLayout | None = None) -> StepOutput:
        """Run the program of ``load_forward`` once on ``batch`` (as in ``run_step``, cut as
        ``layout`` says), the modules in eval mode; returns the losses this rank computed."""
        if self._forward is None:
            raise ExecutionError(f"rank {self.rank}: no forward-only program loaded", ranks=(self.rank,))
        program, device = self._forward.program, self.backend.device
        if layout is None:
            return self._forward.run(received_microbatches(program, batch, device), self._step)
        chunks = received_microbatches(program, batch, device, layout.sizes)
        return self._forward.run(chunks, self._step, self._tables(layout))

    def _tables(self, layout: RankLayout) -> dict[int, dict[str, tuple[int, ...]]]:
        """Each microbatch's shape table (``add_shapes``) by the keys of ``layout``."""
        try:
            return {mb: self._shapes[key] for mb, key in enumerate(layout.shapes) if key is not None}
        except KeyError as exc:
            raise ExecutionError(f"rank {self.rank}: no shapes for {exc.args[0]!r} (add_shapes)",
                                 ranks=(self.rank,)) from None

    @property
    def threads(self) -> bool:
        """Whether steps run one thread per stream (else one sequential walk)."""
        return self._executor.threads

    def run_step(self, batch: Mapping[str, Any], **options: Any) -> StepOutput:
        """``run_steps`` of one ``RankStep(batch, **options)``."""
        return self._run(RankStep(batch, **options))

    def run_steps(self, steps: Sequence[RankStep]) -> list[StepOutput]:
        """Run this rank's instructions once per ``steps`` (``piper_runtime.results.RankStep``),
        in order: several steps in one call (``Runtime.submit_steps``). A step that raises
        ends the call."""
        return [self._run(step) for step in steps]

    def _run(self, step: RankStep) -> StepOutput:
        keep_grads, profile, lr, memory = step.keep_grads, step.profile, step.lr, step.memory
        snapshot = profile and self._memory_snapshot
        memory = memory or snapshot  # the samples are the snapshot's timeline
        self._step += 1
        self._cores.follow()  # Ray may run this call on another thread than setup
        if lr is not None:
            self._optimizers.set_lr(lr)
        started = time.perf_counter()
        compiled_before = self._compile_stats.total_s
        if self._backup is not None:
            self._backup.save()
        layout = step.layout
        if layout is None:
            chunks = received_microbatches(self.program, step.batch, self.backend.device)
            st = StepState(chunks, keep_grads, step=self._step - 1, accounted=memory)
        else:
            chunks = received_microbatches(self.program, step.batch, self.backend.device, layout.sizes)
            st = StepState(chunks, keep_grads, step=self._step - 1, accounted=memory, shapes=self._tables(layout),
                           divisors=layout.divisors)
        self._reads.start(st)
        self._sampler.begin(st, excluded=[t for ts in chunks.values() for t in ts], active=memory,
                            timeline_from=started if snapshot else None)
        kernels = profile and self._profile_kernels
        try:
            cuda = self.backend.device.type == "cuda"
            ranks_here = 1 if self._own_process else self.program.world_size
            with kernel_trace(kernels, cuda, self._timeout_s, ranks_here) as trace, cuda_history(snapshot and cuda) as history:
                timings = self._executor.run(st, self._step, started, profile, memory, labels=kernels)
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
            trace[0],
            tuple(self._sampler.tracker.timeline) if snapshot else (),
            history[0],
            self._compile_stats.total_s - compiled_before,
        )

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
        objects = {**objects, f"rng.rank{self.rank}": rng_state(self.backend.device)}
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
            set_rng_state(read_objects(path, [key])[key], self.backend.device)

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
        self._cores.release()
        fresh, own_process = self._fresh, self._own_process
        self.__dict__.clear()
        self._fresh, self._own_process = fresh, own_process
        self._forget()
        fresh.restore()
        # The run's tensors and autograd graphs go now, not at some later step; what survives
        # (modules the run imported, caches) stays, and is not looked at again: a full
        # collection over everything took 0.22-0.25 s per reset, over the run's objects alone
        # a few ms.
        gc.collect()
        gc.freeze()
        return os.getpid()
