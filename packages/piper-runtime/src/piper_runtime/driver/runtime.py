"""``Runtime``: one Ray actor per rank executing a ``Program``, driven from this process.

Start-up: connect to Ray (``cluster``), pick the backend, reserve one placement-group
bundle per rank (``placement``: policy ``pack`` or ``spread``, fails fast when the cluster is
too small), start the actors in their bundles (or, reusing workers on a one-node cluster,
take them from a ``WorkerPool``: ``pool``), then rendezvous (``rendezvous``): loopback
when every rank is on one node, else the address Ray reports for rank 0's node, with a port
that rank 0's own process opens and keeps for its TCP store.

Workers are started for the runtime and killed by ``shutdown``, unless the runtime reuses
workers (``reuse_workers``, ``piper_runtime.driver.pool``): then it takes them from a pool and a
clean ``shutdown`` resets them and gives them back. A failed run's workers, and those of a
runtime shut down while a call was still in flight, are killed all the same.

Failure policy: whatever goes wrong on a worker (an exception, a dead actor, no answer
before the timeout) tears every actor down first, so no rank is left blocked in a receive,
and then raises ``piper_ir.ExecutionError`` naming the ranks (and, for an exception, the
instruction and the worker's traceback).

Hung ranks: while a step is in flight, once it has run for ``timeout_s``, the driver reads
every unfinished rank's progress (``piper_runtime.progress``) every ``_WATCH_INTERVAL_S``;
when some rank has made no progress for ``timeout_s`` (60 s by default) the step fails with
``HangError``: which rank is stuck in which instruction, for how long, and what its peers
were doing. A step that keeps making progress may run as long as it needs (unless
``step_timeout_s`` bounds it). On the workers, every single wait (a receive, a collective,
an event) is bounded too, at ``worker_timeout(timeout_s)``, longer than the watchdog's bound
so that the driver's report, which names the culprit, comes first.
"""

from __future__ import annotations

import collections
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from torch import nn

from piper_ir import ClusterError, ExecutionError, HangError, NumericalError, PiperError, Program
from piper_runtime.backends import backend_factory, cuda_missing
from piper_runtime.batch import batch_reads, check_batch, replica_slice, to_wire
from piper_runtime.driver.cluster import choose_backend, ensure_ray, worker_env
from piper_runtime.driver.merge import merge_outputs, merge_parameters
from piper_runtime.driver.placement import Placement, check_resources, place_ranks
from piper_runtime.driver.pool import (
    MONITOR,
    WRITER,
    WorkerPool,
    WorkerSpec,
    kill_workers,
    pool_for,
    worker_actor,
)
from piper_runtime.driver.user_code import ship_by_value
from piper_runtime.numerics import check_on_nan, first_nonfinite
from piper_runtime.optim import OptimizerSpec
from piper_runtime.progress import RankProgress, hang_report
from piper_runtime.rank.accumulation import MIN_WEIGHT_BYTES, describe_fusion
from piper_runtime.rank.cores import core_slices, describe
from piper_runtime.rank.precision import compute_inputs
from piper_runtime.rendezvous import LOOPBACK
from piper_runtime.results import StepOutput, StepResult

_INLINE_BYTES = 64 * 1024  # below this, batch tensors go inline with each call
_RESET_TIMEOUT_S = 30.0
DEFAULT_TIMEOUT_S = 60.0  # no progress on a rank for this long: the step fails (HangError)
_WATCH_INTERVAL_S = 1.0  # how often the watchdog reads progress, once a step ran for timeout_s
_PROGRESS_ANSWER_S = 5.0  # a rank that does not say what it does within this is reported silent


def worker_timeout(timeout_s: float) -> float:
    """The bound on any single wait inside a worker for a run with watchdog bound
    ``timeout_s``: twice that plus a margin (and at least a minute, the join's bound), so
    the driver's watchdog, which names the culprit, fires first."""
    return max(60.0, 2 * timeout_s + 10.0)


class Runtime:
    """Executes ``program`` on ``program.world_size`` Ray actors.

    ``modules`` maps segment ids to the ``nn.Module`` running each segment (see
    docs/ir-conventions.md, section 6); each rank receives only the modules of the segments
    in its plan. Use as a context manager, or call ``shutdown``; actors are also killed when
    the runtime is garbage collected or the interpreter exits. ``threads`` runs each rank's
    logical streams on threads of their own (the default); ``False`` walks each rank's plan
    sequentially, the same plan on one stream. ``fuse_loss_backward=False`` runs every loss
    backward apart from its stage's (``piper_runtime.rank.compute``): the same results, and a
    profile that times each segment alone. ``grad_fusion_min_bytes``: ``nn.Linear`` weights
    of at least this many bytes have each microbatch's gradient added into ``.grad`` by the
    matrix product that computes it (``piper_runtime.rank.accumulation``; ``None``: autograd adds
    every one). ``input_grads_first``: a stage's last backward of the step, whose input
    gradient another rank waits for, sends it before those layers add their weight products
    (``piper_runtime.rank.input_grads_first``; the same gradients, bit for bit). ``bind_cores``:
    where a host has a free core per rank (one no other job's rank claims), bind each rank's
    step threads to cores of its own
    (``piper_runtime.rank.cores``; ``log`` hears which); ``False`` leaves them to the operating
    system.

    ``backend``: a registered backend name, or ``None`` to choose (``cuda`` when the cluster
    has a GPU for every rank and the CUDA backend can run there, else ``cpu``; the choice and
    why are in ``backend_reason``, and ``log`` hears it). ``placement``: ``"pack"`` or
    ``"spread"`` (``piper_runtime.driver.placement``); each rank reserves ``cpus_per_rank`` CPUs and,
    on a GPU backend, ``1 / ranks_per_gpu`` of a GPU (``ranks_per_gpu`` > 1 shares GPUs).
    A cluster too small for the program, or an unreachable ``address``, raises
    ``piper_ir.ClusterError`` before any actor starts.

    ``timeout_s``: a rank that makes no progress (starts or ends no instruction) for this
    long during a step fails the step with ``piper_ir.HangError`` naming it (module doc);
    ``step_timeout_s``, when given, also bounds each step's whole duration.

    ``on_nan``: what a NaN or Inf loss or gradient does (``piper_runtime.numerics``):
    ``"stop"`` raises ``piper_ir.NumericalError`` naming the step, microbatch and rank where
    it first appeared; ``"skip-step"`` undoes the step on every rank (parameters and
    optimizer state exactly as before it; each worker keeps a copy of that state);
    ``"continue"`` keeps the step. ``StepResult.nonfinite`` says what was found.

    ``reuse_workers``: ``True`` takes workers from the process's shared ``WorkerPool`` and
    gives them back on a clean ``shutdown``; a ``WorkerPool`` uses that pool; ``False``
    starts new workers and kills them at the end; ``None`` (the default) reuses only when
    the environment says ``PIPER_REUSE_WORKERS=1``. Reuse applies on a one-node cluster
    (pooled workers reserve no placement-group bundle, and the rendezvous is on loopback);
    on several nodes the runtime places new workers as usual.

    ``seed``: every forward draws its random numbers for (seed, segment, microbatch, step,
    replica) (``piper_runtime.rank.randomness``), the steps counted from 0 by this runtime.
    ``by_value``: names of imported modules the segment modules refer to that a worker cannot
    import (the user's own code, ``CapturedModel.user_modules``): their code travels with the
    modules (``piper_runtime.driver.user_code``).
    """

    def __init__(
        self,
        program: Program,
        modules: Mapping[str, nn.Module],
        optimizer: OptimizerSpec | None = None,
        *,
        address: str | None = None,
        backend: str | None = "cpu",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        step_timeout_s: float | None = None,
        on_nan: str = "stop",
        setup_timeout_s: float = 120.0,
        threads: bool = True,
        fuse_loss_backward: bool = True,
        grad_fusion_min_bytes: int | None = MIN_WEIGHT_BYTES,
        input_grads_first: bool = True,
        bind_cores: bool = True,
        placement: str = "pack",
        ranks_per_gpu: int = 1,
        cpus_per_rank: float = 1.0,
        log: Callable[[str], None] | None = None,
        reuse_workers: bool | WorkerPool | None = None,
        seed: int = 0,
        by_value: Sequence[str] = (),
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.program = program
        self.on_nan = check_on_nan(on_nan)
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self._workers: list[Any] = []
        self._steps = 0
        self._in_flight = False  # a call was sent and its answers not all gathered
        self._writing: PendingSave | None = None  # a checkpoint whose files the ranks are writing
        self._pending: collections.deque[PendingStep] = collections.deque()  # submitted, not gathered
        if backend is not None:
            backend_factory(backend)  # an unknown name fails before anything starts
        if ranks_per_gpu < 1:
            raise ValueError(f"ranks_per_gpu must be >= 1, got {ranks_per_gpu!r}")
        self._forward: Program | None = None  # the evaluation step (``load_forward``)
        self._forward_names: dict[int, tuple[str, ...]] = {}
        needed = {s for plan in program.ranks for s in plan.segments()}
        missing = sorted(needed - set(modules))
        if missing:
            raise ValueError(f"no module given for segments {missing}")
        if len(program.ranks) != program.world_size:
            raise ValueError(
                f"program has {len(program.ranks)} rank plans for world size {program.world_size}"
            )

        if backend == "cuda" and address is None and not ray.is_initialized():
            # The embedded cluster would run on this machine: no need to start it to know.
            lacking = cuda_missing()
            if lacking:
                raise ClusterError(f"backend 'cuda' needs a GPU for each rank, and this machine has none usable: {lacking}")
        # The embedded cluster gets a logical CPU per rank even on a smaller machine: ranks
        # mostly wait on each other.
        ensure_ray(address, num_cpus=max(os.cpu_count() or 1, int(program.world_size * cpus_per_rank + 0.999)))
        ship_by_value(by_value)  # before anything is pickled for the workers
        self.backend_name, self.backend_reason = choose_backend(backend, program.world_size, 1.0 / ranks_per_gpu)
        if log is not None:
            log(self.backend_reason)
        # Built here too, unconnected: it says what a rank needs. Workers get the factory
        # itself, so a backend registered in this process only works too.
        factory = backend_factory(self.backend_name)
        self._backend = factory()
        gpus_per_rank = self._backend.gpus_per_rank / ranks_per_gpu
        self._pool = pool_for(reuse_workers) if _one_node() else None
        self._spec = WorkerSpec.of(self.backend_name, gpus_per_rank, worker_env())
        self.placement: Placement | None = None
        if self._pool is not None:
            # Pooled workers reserve no bundle, but a cluster too small is refused all the same.
            check_resources(program.world_size, cpus_per_rank, gpus_per_rank, ray.cluster_resources(), self.backend_name)
            self._workers = self._pool.acquire(program.world_size, self._spec)
            # Kills the actors on failure, garbage collection or interpreter exit, whichever
            # first (a clean shutdown into the pool detaches it instead).
            self._finalizer = weakref.finalize(self, kill_workers, list(self._workers))
            address0 = LOOPBACK
        else:
            self.placement = place_ranks(
                program,
                cpus_per_rank=cpus_per_rank,
                gpus_per_rank=gpus_per_rank,
                policy=placement,
                backend=self.backend_name,
                timeout_s=min(setup_timeout_s, 30.0),
            )
            env = {"env_vars": worker_env()}
            self._workers = [
                worker_actor(max_restarts=0, runtime_env=env, **self.placement.actor_options(rank)).remote()
                for rank in range(program.world_size)
            ]
            # Kills the actors and releases their reservation on shutdown, garbage collection
            # or interpreter exit, whichever first.
            self._finalizer = weakref.finalize(self, _kill, list(self._workers), self.placement)
            address0 = self.placement.rendezvous_address
        self._batch_names = {r: batch_reads(program, r) for r in range(program.world_size)}

        # Rank 0's process opens the port on its own node and keeps it for its TCP store.
        (port,) = self._gather([self._workers[0].open_rendezvous.remote(address0)], setup_timeout_s, "rendezvous")
        self.rendezvous = (address0, port)
        cores: dict[int, tuple[int, ...]] = {}
        claimed: dict[str, tuple[int, ...]] = {}  # by host name: cores other jobs hold
        if bind_cores:
            hosts = self._gather([w.host.remote() for w in self._workers], setup_timeout_s, "setup")
            cores = core_slices([(host, free) for host, free, _ in hosts])
            claimed = {host.partition("/")[0]: held for host, _, held in hosts}
        program_ref = ray.put(program)
        calls = [
            w.setup.remote(
                rank,
                program.world_size,
                address0,
                port,
                program_ref,
                {s: modules[s] for s in program.plan(rank).segments()},
                optimizer or OptimizerSpec(),
                factory,
                worker_timeout(timeout_s),
                threads,
                seed,
                on_nan == "skip-step",
                fuse_loss_backward=fuse_loss_backward,
                cores=cores.get(rank, ()),
                grad_fusion_min_bytes=grad_fusion_min_bytes,
                input_grads_first=input_grads_first,
            )
            for rank, w in enumerate(self._workers)
        ]
        answers = self._gather(calls, setup_timeout_s, "setup")
        if log is not None:  # what each rank holds: a core another job claimed meanwhile is not bound
            bound = {r: c for r, (c, _) in enumerate(answers) if c}
            log(describe(bound, program.world_size, bind_cores, claimed, planned=cores))
            fused = {r: n for r, (_, n) in enumerate(answers) if n}
            if fused:
                log(describe_fusion(fused, grad_fusion_min_bytes, input_grads_first))

    # -- public API ---------------------------------------------------------------------------

    def step(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        keep_grads: bool = False,
        profile: bool = False,
        lr: float | None = None,
        memory: bool = False,
    ) -> StepResult:
        """Run one training step on a whole batch (split into the program's microbatches).

        ``keep_grads`` returns every parameter's gradient; ``profile`` returns when each
        instruction ran on each rank (``StepResult.timings``); ``lr`` sets the learning rate
        of every optimizer group from this step on (a schedule's value for the step);
        ``memory`` returns each rank's peak memory by category (``StepResult.memory``; it
        costs time on every instruction, so it is off unless asked for).
        ``step`` is ``submit(...).result()``."""
        return self.submit(inputs, targets, keep_grads, profile, lr, memory).result()

    def submit(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        keep_grads: bool = False,
        profile: bool = False,
        lr: float | None = None,
        memory: bool = False,
    ) -> PendingStep:
        """Send one training step to the workers and return at once (arguments as for
        ``step``); ``PendingStep.result()`` waits for it. Steps run in submission order on
        every rank (one actor runs one call at a time, in the order its caller sent them), so
        submitting step N+1 before N's result is in computes exactly what ``step`` after
        ``step`` does, while the batch hand-over and the driver's round trip overlap the
        workers' compute. Results are gathered in order; a failure tears the run down as
        ``step`` does, and fails every later pending step too. The caller bounds how many
        steps it keeps in flight (one or two ahead suffice to hide the round trip). With
        ``on_nan="skip-step"`` a step is sent only once the ones before it are gathered:
        undoing a step restores the state from before it, so none may have run after it."""
        (pending,) = self.submit_steps([StepRequest(inputs, targets, keep_grads, profile, lr, memory)])
        return pending

    def submit_steps(self, requests: Sequence[StepRequest]) -> list[PendingStep]:
        """Send several consecutive training steps in one call per rank, and return at once:
        one ``PendingStep`` per request, in order. Each step is exactly what ``submit``
        would run; what is saved is each step's call to the workers, which costs a rank about
        a millisecond between steps on a 2-core host (Ray's hand-over of the call), a
        tenth of a small model's step. The price: the results of a call arrive together
        when its last step ends; a step that fails fails the call, so waiting for any of
        its steps raises the error, which names the step that failed (the run is torn down
        either way); a NaN with ``on_nan="stop"`` is reported after the call's later steps
        have run; and ``step_timeout_s`` bounds the call at that many seconds per step. Not
        with ``on_nan="skip-step"`` (a step must be undone before the next one runs)."""
        self._check_open()
        if not requests:
            return []
        if len(requests) > 1 and self.on_nan == "skip-step":
            raise ValueError("several steps per call cannot be undone one by one: not with on_nan='skip-step'")
        program = self.program
        shipments = []
        for r in requests:
            batch = check_batch(program, compute_inputs(program.precision, r.inputs), r.targets)
            shipments.append(_shipments(program, self._batch_names, batch))
        if self.on_nan == "skip-step" and self._pending:
            # Undoing a step restores the state from before it: no later step may have run.
            self._collect()
        call = _Call([
            w.run_steps.remote([(shipped[rank], *r.options()) for r, shipped in zip(requests, shipments, strict=True)])
            for rank, w in enumerate(self._workers)
        ], len(requests))
        pendings = []
        for index, r in enumerate(requests):
            self._steps += 1
            pendings.append(PendingStep(self, self._steps, call, index, r.keep_grads, r.lr))
        self._pending.extend(pendings)
        self._in_flight = True
        return pendings

    def _collect(self, upto: PendingStep | None = None) -> None:
        """Gather pending steps in submission order, through ``upto`` (all without it)."""
        while self._pending:
            head = self._pending[0]
            call = head.call
            if call.outputs is None:
                timeout_s = None if self.step_timeout_s is None else self.step_timeout_s * call.steps
                call.outputs = self._gather(call.refs, timeout_s, "step", head.step, watch=True)
            outputs: list[StepOutput] = [per_rank[head.index] for per_rank in call.outputs]
            self._pending.popleft()
            self._in_flight = bool(self._pending)
            found = first_nonfinite([(o.rank, o.losses, o.nonfinite) for o in outputs])
            if found is not None and self.on_nan == "stop":
                self._fail(NumericalError(
                    f"step {head.step}: {found}; the run stops (on_nan='stop'; 'skip-step' undoes such a step, "
                    "'continue' keeps it)",
                    step=head.step,
                ))
            skipped = found is not None and self.on_nan == "skip-step"
            if skipped:  # no step runs ahead under skip-step (``submit``): the backup is this step's
                self._gather([w.restore.remote() for w in self._workers], 60.0, "restore")
            result = merge_outputs(outputs, self.program, head.keep_grads)
            result = attrs.evolve(result, nonfinite=found, skipped=skipped)
            head.done = result if head.lr is None else attrs.evolve(result, lr=head.lr)
            if head is upto:
                return

    def load_forward(self, program: Program) -> None:
        """Give the workers ``program``, a forward-only step of the same world compiled from
        the training graph (``piper_scheduler.forward_only``), for ``evaluate``."""
        self._check_open()
        self._collect()
        if program.world_size != self.program.world_size:
            raise ValueError(
                f"the forward-only program has {program.world_size} ranks, the runtime {self.program.world_size}"
            )
        self._forward = program
        self._forward_names = {r: batch_reads(program, r) for r in range(program.world_size)}
        ref = ray.put(program)
        self._gather([w.load_forward.remote(ref) for w in self._workers], 60.0, "load_forward")

    def evaluate(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> StepResult:
        """Run the program of ``load_forward`` on a whole batch, the modules in eval mode: no
        gradient, no update. ``losses``/``loss`` as for ``step``."""
        self._check_open()
        self._collect()
        program = self._forward
        if program is None:
            raise ExecutionError("no forward-only program: call load_forward first")
        shipments = _shipments(
            program, self._forward_names, check_batch(program, compute_inputs(program.precision, inputs), targets)
        )
        calls = [w.run_forward.remote(shipments[rank]) for rank, w in enumerate(self._workers)]
        outputs: list[StepOutput] = self._gather(calls, self.step_timeout_s, "evaluate")
        return merge_outputs(outputs, program, False)

    def parameters(self) -> dict[str, torch.Tensor]:
        """Current parameters of every segment, by qualified name, merged over ranks (after
        every submitted step)."""
        self._check_open()
        self._collect()
        per_rank = self._gather([w.parameters.remote() for w in self._workers], 60.0, "parameters")
        shards = self._gather([w.parameter_shards.remote() for w in self._workers], 60.0, "parameters")
        return merge_parameters(self.program, per_rank, shards)

    def save_checkpoint(
        self, path: str, objects: Mapping[str, Any] | None = None, timeout_s: float = 300.0, *, wait: bool = True
    ) -> PendingSave | None:
        """Write a checkpoint into the (new, empty) directory ``path``: every rank writes
        what it holds (``piper_runtime.checkpoint``), rank 0 also ``objects`` (data by key:
        ``checkpoint_files.encode``); ``index.json`` is written last, by this process. Not
        atomic by itself: the caller writes into a temporary directory and renames it.

        ``wait=False``: return once every rank has copied what it holds (its local plan);
        the ranks write their files on a thread of their own (``WRITER``) while the next
        steps run, and the returned ``PendingSave`` completes the checkpoint (``wait``)."""
        from piper_runtime.checkpoint import plan_globally  # on first use, as the workers import it

        self._check_open()
        if self._writing is not None:
            self._writing.wait(timeout_s)  # one checkpoint written at a time
        self._collect()  # after every submitted step
        extra = dict(objects or {})
        plans = self._gather(
            [w.checkpoint_plan.remote(path, extra if rank == 0 else {}) for rank, w in enumerate(self._workers)],
            timeout_s, "checkpoint",
        )
        plans, metadata = plan_globally(path, plans)
        refs = [w.checkpoint_write.options(concurrency_group=WRITER).remote(plan)
                for w, plan in zip(self._workers, plans, strict=True)]
        pending = self._writing = PendingSave(self, path, metadata, refs)
        if not wait:
            return pending
        pending.wait(timeout_s)
        return None

    def load_checkpoint(self, path: str, step: int, rng: bool = False, timeout_s: float = 300.0) -> None:
        """Every rank reads its parameters and optimizer state from the checkpoint at
        ``path``, whatever strategy wrote it; ``step``: the optimizer steps it holds. ``rng``:
        each rank also restores its generators (only for a checkpoint of this very program)."""
        self._check_open()
        self._collect()
        self._gather([w.load_checkpoint.remote(path, step, rng) for w in self._workers], timeout_s, "load checkpoint")
        self._steps = step

    def worker_pids(self) -> list[int]:
        """The process id of each rank's worker, in rank order."""
        self._check_open()
        return self._gather([w.ping.remote() for w in self._workers], 30.0, "ping")

    def shutdown(self) -> None:
        """Stop the workers (leaving the process group first), or, when reusing workers,
        reset them and give them back to the pool. Safe to call more than once."""
        if not self._finalizer.alive:
            return
        if self._pool is not None and not self._in_flight and self._writing is None and self._reset_workers():
            self._finalizer.detach()
            workers, self._workers = self._workers, []  # the pool's now, maybe another runtime's
            self._pool.release(workers, self._spec)
            return
        try:
            ray.wait([w.shutdown.remote() for w in self._workers], num_returns=len(self._workers), timeout=10)
        finally:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._workers or not self._finalizer.alive

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ExecutionError("the runtime is shut down (after shutdown() or an earlier failure)")

    def _reset_workers(self) -> bool:
        """Reset every worker for reuse; whether all of them answered in time."""
        refs = [w.reset.remote() for w in self._workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_RESET_TIMEOUT_S)
        if len(ready) < len(refs):
            return False
        try:
            ray.get(refs, timeout=_RESET_TIMEOUT_S)
        except Exception:  # a worker that cannot forget its run is not reused
            return False
        return True

    def _gather(
        self, refs: list[Any], timeout_s: float | None, what: str, step: int | None = None, watch: bool = False
    ) -> list[Any]:
        """Results of one call per rank, in rank order; the first failure tears down and
        raises. ``timeout_s``: for all the answers (``None``: no bound); ``watch``: the
        hung-rank watchdog (module doc) watches the ranks meanwhile."""
        self._in_flight = True  # until every answer is in: a rank may still be running
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        step = step if step is not None or what != "step" else self._steps
        while pending:
            now = time.monotonic()
            wait_s = None if deadline is None else max(0.0, deadline - now)
            if watch:
                # No rank can have been idle for timeout_s before the step ran that long.
                look = max(started + self.timeout_s - now, _WATCH_INTERVAL_S)
                wait_s = look if wait_s is None else min(wait_s, look)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            if not ready and deadline is not None and time.monotonic() >= deadline:
                ranks = sorted(pending.values())
                if watch:  # a call may run several steps: the one the ranks are in
                    step = self._running_step(ranks, step)
                self._fail(
                    ExecutionError(
                        f"{what}: ranks {ranks} did not answer within {timeout_s:g} s", ranks=ranks, step=step
                    )
                )
            if not ready and watch and time.monotonic() >= started + self.timeout_s:
                self._watch(sorted(pending.values()), sorted(results), step)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref, timeout=10)
                except RayTaskError as exc:
                    cause = exc.cause
                    if isinstance(cause, PiperError):
                        # An ExecutionError subclass (HangError, NumericalError) keeps its type.
                        kind = type(cause) if isinstance(cause, ExecutionError) else ExecutionError
                        # A call may run several steps: the worker's count says which one failed.
                        failed = cause.step if what == "step" and cause.step is not None else step
                        err = kind(
                            cause.message, ranks=cause.ranks or (rank,), nodes=cause.nodes, step=failed
                        )
                    else:
                        err = ExecutionError(
                            f"rank {rank} failed during {what}:\n{exc}", ranks=(rank,), step=step
                        )
                        err.__cause__ = cause  # what the rank raised: an OSError's errno, say (fit's restarts)
                    self._fail(err)
                except RayActorError as exc:
                    self._fail(
                        ExecutionError(f"rank {rank} died during {what}: {exc}", ranks=(rank,), step=step)
                    )
                except GetTimeoutError:
                    self._fail(
                        ExecutionError(f"{what}: rank {rank} did not answer", ranks=(rank,), step=step)
                    )
        self._in_flight = bool(self._pending)  # submitted steps not gathered yet
        return [results[r] for r in range(len(refs))]

    def _progress(self, ranks: list[int]) -> tuple[dict[int, RankProgress], list[int]]:
        """What each of ``ranks`` says it is doing; and the ranks that did not answer within
        ``_PROGRESS_ANSWER_S`` (silent). A dead rank, or one that cannot say, is in neither:
        the step's own answer says what happened to it."""
        calls = {rank: self._workers[rank].progress.options(concurrency_group=MONITOR).remote() for rank in ranks}
        ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=_PROGRESS_ANSWER_S)
        answered: dict[int, RankProgress] = {}
        for rank, ref in calls.items():
            if ref in ready:
                try:
                    snapshot = ray.get(ref, timeout=1)
                except Exception:
                    snapshot = None
                if snapshot is not None:
                    answered[rank] = snapshot
        return answered, [r for r in ranks if calls[r] not in ready]

    def _running_step(self, ranks: list[int], step: int | None) -> int | None:
        """The latest step one of ``ranks`` is running, else ``step``."""
        running = [p.step for p in self._progress(ranks)[0].values() if p.running]
        return max(running) if running else step

    def _watch(self, pending: list[int], finished: list[int], step: int | None) -> None:
        """Fail with ``HangError`` if some rank of ``pending`` made no progress for
        ``timeout_s`` (or does not say what it does)."""
        answered, silent = self._progress(pending)
        stuck = silent or [r for r, p in answered.items() if p.running and p.idle_s >= self.timeout_s]
        if not stuck:
            return
        groups = {c.id: c.ranks for c in self.program.communicators}
        rank, node, message = hang_report(answered, silent, finished, groups, self.timeout_s)
        if rank in answered and answered[rank].running:  # a call may run several steps: the rank's own
            step = answered[rank].step
        self._fail(HangError(f"step {step}: {message}", ranks=(rank,), nodes=(node,) if node else (), step=step))

    def _fail(self, err: ExecutionError) -> None:
        self._finalizer()  # kill every actor: peers may be blocked in a receive from the culprit
        raise err


@attrs.frozen
class StepRequest:
    """One step for ``Runtime.submit_steps``: a whole batch and ``submit``'s options."""

    inputs: Sequence[torch.Tensor]
    targets: Sequence[torch.Tensor]
    keep_grads: bool = False
    profile: bool = False
    lr: float | None = None
    memory: bool = False

    def options(self) -> tuple[bool, bool, float | None, bool]:
        """``RankWorker.run_step``'s arguments after the batch."""
        return self.keep_grads, self.profile, self.lr, self.memory


class _Call:
    """One call per rank that runs some consecutive steps; ``outputs`` (per rank, per step)
    once gathered."""

    def __init__(self, refs: list[Any], steps: int) -> None:
        self.refs = refs
        self.steps = steps
        self.outputs: list[list[StepOutput]] | None = None


class PendingStep:
    """A step sent by ``Runtime.submit`` (or ``submit_steps``); ``result()`` waits for it
    (and for the steps submitted before it) and returns its ``StepResult``."""

    def __init__(
        self, runtime: Runtime, step: int, call: _Call, index: int, keep_grads: bool, lr: float | None
    ) -> None:
        self.runtime = runtime
        self.step = step
        self.call = call  # the call that runs it, as step ``index`` of its steps
        self.index = index
        self.keep_grads = keep_grads
        self.lr = lr
        self.done: StepResult | None = None

    def result(self) -> StepResult:
        if self.done is None:
            self.runtime._check_open()
            self.runtime._collect(self)
        assert self.done is not None  # _collect gathered it or raised
        return self.done


class PendingSave:
    """A checkpoint whose files the ranks are writing (``Runtime.save_checkpoint(wait=False)``):
    ``done()`` says whether every rank has finished, ``wait()`` waits for them and writes
    ``index.json``, which completes the checkpoint's data. A rank that fails while writing fails
    the runtime, as a failing step does (``ExecutionError``)."""

    def __init__(self, runtime: Runtime, path: str, metadata: Any, refs: list[Any]) -> None:
        self.runtime = runtime
        self.path = path
        self.metadata = metadata
        self.refs = refs
        self.finished = False

    def done(self) -> bool:
        """Whether every rank's files are written (or a rank failed): ``wait`` will not block."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def wait(self, timeout_s: float = 300.0) -> None:
        from piper_runtime.checkpoint import finish

        if self.finished:
            return
        try:
            results = self.runtime._gather(self.refs, timeout_s, "checkpoint")
        finally:
            self.finished = True
            if self.runtime._writing is self:
                self.runtime._writing = None
        finish(self.path, self.metadata, results)

    def abandon(self) -> None:
        """Give the checkpoint up without waiting (the runtime failed: its ranks are gone)."""
        self.finished = True
        if self.runtime._writing is self:
            self.runtime._writing = None


def _one_node() -> bool:
    """Whether the Ray cluster this process is connected to has a single live node."""
    return sum(1 for n in ray.nodes() if n.get("Alive")) == 1


def _shipments(
    program: Program, names: Mapping[int, Sequence[str]], batch: Mapping[str, torch.Tensor]
) -> list[dict[str, Any]]:
    """What each rank receives of a checked batch: only the batch values it reads
    (``batch_reads``), and with data parallelism only its replica's shards of them. Small
    tensors travel inline with the call (Ray stores large ones in its object store by
    itself); an explicit ray.put pays off only for a large slice that several ranks read (an
    object-store round trip on every step). Tensors travel as ``batch.to_wire`` makes them."""
    slices: dict[tuple[str, int], torch.Tensor] = {}
    readers: dict[tuple[str, int], int] = {}
    for rank, wanted in names.items():
        replica = program.plan(rank).replica
        for n in wanted:
            key = (n, replica)
            if key not in slices:
                meta = program.value_by_name[n].meta
                slices[key] = replica_slice(batch[n], meta, program.microbatches, program.replicas, replica)
            readers[key] = readers.get(key, 0) + 1
    refs = {
        key: ray.put(to_wire(t)) if readers[key] > 1 and t.nbytes > _INLINE_BYTES else to_wire(t)
        for key, t in slices.items()
    }
    return [
        {n: refs[(n, program.plan(rank).replica)] for n in names[rank]} for rank in range(program.world_size)
    ]


def _kill(workers: list[Any], placement: Placement | None = None) -> None:
    kill_workers(workers)
    if placement is not None:
        placement.release()
