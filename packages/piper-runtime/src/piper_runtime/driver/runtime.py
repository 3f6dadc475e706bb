"""``Runtime``: the driver of a ``Program``'s ranks, whatever starts them.

The ranks are ``RankWorker``s reached through ``Ranks`` (``piper_runtime.driver.ranks``):
Ray actors (``ray``: ``ray_ranks``), threads of this process (``local``), or, under a
launcher, this process's own rank (``torchrun``: ``spmd_ranks``). Everything else is here,
once: start-up (rendezvous, core binding, each rank's setup), steps in flight, gathering
answers in rank order, the watchdog, evaluation, checkpoints, merging results.

Failure policy: whatever goes wrong on a rank (an exception, a dead worker, no answer
before the timeout) ends every rank first, so none is left blocked in a receive, and then
raises ``piper_ir.ExecutionError`` naming the ranks (and, for an exception, the instruction
and the rank's traceback). A clean ``shutdown`` of pooled Ray workers gives them back to the
pool (``piper_runtime.driver.pool``).

Hung ranks: while a step is in flight, once it has run for ``timeout_s``, the driver reads
every unfinished rank's progress (``piper_runtime.progress``) every ``_WATCH_INTERVAL_S``;
when some rank has made no progress for ``timeout_s`` (60 s by default) the step fails with
``HangError``: which rank is stuck in which instruction, for how long, and what its peers
were doing. A step that keeps making progress may run as long as it needs (unless
``step_timeout_s`` bounds it). On the ranks, every single wait (a receive, a collective,
an event) is bounded too, at ``FaultOptions.worker_timeout()``, longer than the watchdog's
bound so that the driver's report, which names the culprit, comes first.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from piper_ir import ClusterError, ExecutionError, HangError, NodeKind, NumericalError, PiperError, Program
from piper_runtime.batch import (
    BatchCut,
    Signature,
    batch_reads,
    check_batch,
    check_dtypes,
    cut_batch,
    describe_signature,
    loss_divisors,
    program_signature,
    replica_slice,
    to_wire,
)
from piper_runtime.driver.merge import merge_outputs, merge_parameters
from piper_runtime.driver.ranks import RankFailure, Ranks, ThreadRanks
from piper_runtime.numerics import first_nonfinite
from piper_runtime.optim import OptimizerSpec
from piper_runtime.options import DEFAULT_TIMEOUT_S, FaultOptions, RankSetup, RunOptions
from piper_runtime.progress import RankProgress, hang_report
from piper_runtime.rank.accumulation import describe_fusion
from piper_runtime.rank.cores import core_slices, describe
from piper_runtime.rank.precision import compute_inputs
from piper_runtime.results import RankLayout, RankStep, StepOutput, StepResult

__all__ = ["DEFAULT_TIMEOUT_S", "PendingSave", "PendingStep", "Runtime", "StepRequest", "start_ranks"]

_INLINE_BYTES = 64 * 1024  # below this, batch tensors go inline with each call
_WATCH_INTERVAL_S = 1.0  # how often the watchdog reads progress, once a step ran for timeout_s
_PROGRESS_ANSWER_S = 5.0  # a rank that does not say what it does within this is reported silent


def worker_timeout(timeout_s: float) -> float:
    """``FaultOptions.worker_timeout`` for a watchdog bound of ``timeout_s``."""
    return FaultOptions(timeout_s=timeout_s).worker_timeout()


BUILT_IN = ("ray", "local", "torchrun")


def start_ranks(
    program: Program, options: RunOptions, log: Callable[[str], None] | None, by_value: Sequence[str]
) -> Ranks:
    """The ranks of ``program``, started as ``options.cluster.runtime`` says (a built-in name)."""
    kind = options.cluster.runtime
    if kind == "local":
        return ThreadRanks(program, options, log, by_value)
    if kind == "ray":
        from piper_runtime.driver.ray_ranks import RayRanks  # Ray only where asked for

        return RayRanks(program, options, log, by_value)
    if kind == "torchrun":
        from piper_runtime.driver.spmd_ranks import SpmdRanks

        return SpmdRanks(program, options, log, by_value)
    raise ClusterError(f"unknown runtime {kind!r}; the built-in ones are {', '.join(BUILT_IN)}")


class Runtime:
    """Executes ``program`` on ``program.world_size`` ranks, started as ``options.cluster.runtime``
    says: ``ray`` (one Ray actor per rank), ``local`` (every rank a thread of this process) or
    ``torchrun`` (this process is one rank of a launched job); ``piper_runtime.runtimes``
    starts a runtime by name, third-party ones included.

    ``modules`` maps segment ids to the ``nn.Module`` running each segment (see
    docs/ir-conventions.md, section 6); each rank receives only the modules of the segments
    in its plan. ``options`` (``piper_runtime.options.RunOptions``; flat ``settings`` such as
    ``timeout_s=`` or ``threads=`` are routed to their concern by ``RunOptions.build``) says
    how ranks run their plans, what bounds the run, what a NaN does and where ranks run. Use
    as a context manager, or call ``shutdown``; ranks are also ended when the runtime is
    garbage collected or the interpreter exits.

    A cluster too small for the program, or an unreachable address, raises
    ``piper_ir.ClusterError`` before any rank starts. A rank that makes no progress for
    ``faults.timeout_s`` during a step fails it with ``piper_ir.HangError`` naming it (module
    doc); ``faults.on_nan``: ``"stop"`` raises ``piper_ir.NumericalError`` naming the step,
    microbatch and rank where a NaN or Inf first appeared; ``"skip-step"`` undoes the step on
    every rank; ``"continue"`` keeps it (``StepResult.nonfinite`` says what was found).
    ``seed``: every forward draws its random numbers for (seed, segment, microbatch, step,
    replica), the steps counted from 0 by this runtime. ``by_value``: names of imported
    modules the segment modules refer to that a worker cannot import (the user's own code,
    ``CapturedModel.user_modules``): their code travels with the modules.
    """

    def __init__(
        self,
        program: Program,
        modules: Mapping[str, nn.Module],
        optimizer: OptimizerSpec | None = None,
        options: RunOptions | None = None,
        *,
        log: Callable[[str], None] | None = None,
        by_value: Sequence[str] = (),
        **settings: Any,
    ) -> None:
        options = RunOptions.build(options, **settings)
        self.options = options
        self.program = program
        self.on_nan = options.faults.on_nan
        self.timeout_s = options.faults.timeout_s
        self.step_timeout_s = options.faults.step_timeout_s
        self._steps = 0
        self._in_flight = False  # a call was sent and its answers not all gathered
        self._writing: PendingSave | None = None  # a checkpoint whose files the ranks are writing
        self._pending: collections.deque[PendingStep] = collections.deque()  # submitted, not gathered
        self._forward: Program | None = None  # the evaluation step (``load_forward``)
        # Programs of the same structure for batches of other shapes (``add_variant``), by the
        # signature of their pieces (``batch.program_signature``); the key the ranks know it by.
        self._variants: dict[Signature, str] = {program_signature(program): ""}
        self._forward_variants: dict[Signature, str] = {}  # the same for the forward-only program
        self._forward_names: dict[int, tuple[str, ...]] = {}
        needed = {s for plan in program.ranks for s in plan.segments()}
        missing = sorted(needed - set(modules))
        if missing:
            raise ValueError(f"no module given for segments {missing}")
        if len(program.ranks) != program.world_size:
            raise ValueError(
                f"program has {len(program.ranks)} rank plans for world size {program.world_size}"
            )
        self._ranks: Ranks = start_ranks(program, options, log, by_value)
        self.backend_name, self.backend_reason = self._ranks.backend_name, self._ranks.backend_reason
        # Whether this process writes what the run writes once (``Ranks.coordinator``: under
        # torchrun every process drives, rank 0's alone writes); the name all give a checkpoint's
        # temporary directory (``Ranks.writer``; None: one driver).
        self.coordinator: bool = getattr(self._ranks, "coordinator", True)
        self.writer: str | None = getattr(self._ranks, "writer", None)
        self.placement = getattr(self._ranks, "placement", None)
        self._batch_names = {r: batch_reads(program, r) for r in range(program.world_size)}
        setup_timeout_s = options.faults.setup_timeout_s
        execution = options.execution
        address0 = self._ranks.address
        # Rank 0's process opens the port on its own node and keeps it for its TCP store.
        (port,) = self._gather([self._ranks.call(0, "open_rendezvous", address0)], setup_timeout_s, "rendezvous")
        self.rendezvous = (address0, port)
        cores: dict[int, tuple[int, ...]] = {}
        claimed: dict[str, tuple[int, ...]] = {}  # by host name: cores other jobs hold
        bind_cores = execution.bind_cores and self._ranks.binds_cores
        if bind_cores:
            hosts = self._gather(self._each("host"), setup_timeout_s, "setup")
            cores = core_slices([(host, free) for host, free, _ in hosts])
            claimed = {host.partition("/")[0]: held for host, _, held in hosts}
        program_ref = self._ranks.share(program)
        setup = RankSetup(
            execution, options.faults.worker_timeout(), options.seed, options.faults.on_nan == "skip-step"
        )
        calls = [
            self._ranks.call(
                rank,
                "setup",
                rank,
                program.world_size,
                address0,
                port,
                program_ref,
                {s: modules[s] for s in program.plan(rank).segments()},
                optimizer or OptimizerSpec(),
                self._ranks.factory,
                attrs.evolve(setup, cores=cores.get(rank, ())),
            )
            for rank in range(program.world_size)
        ]
        answers = self._gather(calls, setup_timeout_s, "setup")
        if log is not None:  # what each rank holds: a core another job claimed meanwhile is not bound
            bound = {r: c for r, (c, _) in enumerate(answers) if c}
            if self._ranks.binds_cores:
                log(describe(bound, program.world_size, bind_cores, claimed, planned=cores))
            fused = {r: n for r, (_, n) in enumerate(answers) if n}
            if fused:
                log(describe_fusion(fused, execution.grad_fusion_min_bytes, execution.input_grads_first))
        # Optional in ``Ranks``: a pool's spare workers start only now (``RayRanks.after_setup``).
        after_setup = getattr(self._ranks, "after_setup", None)
        if after_setup is not None:
            after_setup()

    @property
    def _workers(self) -> list[Any]:
        """The ranks' workers (Ray actor handles, or ``RankWorker``s of this process): for tests."""
        return list(getattr(self._ranks, "workers", []))

    def agree(self, value: Any) -> Any:
        """The coordinator's ``value``, in every process of a launched job, where each runs this
        driver (``spmd_ranks``): what a process decides by its clock (how many steps go in a
        call) must be the same in all, or their calls would differ. ``value`` itself elsewhere."""
        agree = getattr(self._ranks, "agree", None)
        return value if agree is None else agree(value)

    def _each(self, method: str, *args: Any, group: str | None = None) -> list[Any]:
        """``method(*args)`` called on every rank, in rank order."""
        return [self._ranks.call(rank, method, *args, group=group) for rank in range(self.program.world_size)]

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
        shipments, layouts, cuts = [], [], []
        for r in requests:
            inputs = compute_inputs(program.precision, r.inputs)
            cut = cut_batch(program, inputs, r.targets)
            if cut.even(program):
                batch = check_batch(program, inputs, r.targets)
                shipments.append(_shipments(program, self._batch_names, batch, self._ranks.share))
                layouts.append([None] * program.world_size)
                cuts.append(None)
                continue
            batch = check_dtypes(program, inputs, r.targets)
            shipments.append(_shipments(program, self._batch_names, batch, self._ranks.share, cut.sizes))
            layouts.append(self._layouts(cut))
            cuts.append(cut.sizes)
        if self.on_nan == "skip-step" and self._pending:
            # Undoing a step restores the state from before it: no later step may have run.
            self._collect()
        call = _Call([
            self._ranks.call(rank, "run_steps", [
                r.for_rank(shipped[rank], layout[rank])
                for r, shipped, layout in zip(requests, shipments, layouts, strict=True)
            ])
            for rank in range(program.world_size)
        ], len(requests))
        pendings = []
        for index, (r, sizes) in enumerate(zip(requests, cuts, strict=True)):
            self._steps += 1
            pendings.append(PendingStep(self, self._steps, call, index, r.keep_grads, r.lr, sizes))
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
                self._gather(self._each("restore"), 60.0, "restore")
            result = merge_outputs(outputs, self.program, head.keep_grads, head.sizes)
            result = attrs.evolve(result, nonfinite=found, skipped=skipped)
            head.done = result if head.lr is None else attrs.evolve(result, lr=head.lr)
            if head is upto:
                return

    def drain(self) -> None:
        """Wait for every submitted step (each ``PendingStep`` keeps its result): nothing runs
        on the ranks when it returns. ``Trainer`` captures the model again for a batch of new
        shapes only then: tracing patches ``nn.Module`` calls process-wide, and under the
        ``local`` and ``torchrun`` runtimes ranks run forwards in this process."""
        self._check_open()
        self._collect()

    @property
    def variants(self) -> int:
        """How many shape variants of the program the ranks hold (``add_variant``), the
        program's own included."""
        return len(self._variants)

    def add_variant(self, program: Program, forward: bool = False) -> None:
        """Let the ranks run batches whose pieces have ``program``'s shapes: ``program`` is
        this runtime's program compiled for another batch shape (the same model, strategy
        and instructions; only the shapes of values differ, which is checked). Each rank
        receives, once, the shapes its transfers have in it where they differ
        (``RankWorker.add_shapes``) and keeps its modules, parameters and optimizer state;
        a later step whose pieces have these shapes uses them (``submit_steps``). ``forward``:
        ``program`` is the forward-only program of ``load_forward`` compiled for other shapes,
        for ``evaluate``."""
        self._check_open()
        base, variants = self._kind(forward)
        signature = program_signature(program)
        if signature in variants:
            return
        difference = structure_difference(base, program)
        if difference:
            raise ValueError(f"the program for shapes {describe_signature(program, signature)} is not this "
                             f"runtime's program with other shapes: {difference}")
        key = ("forward " if forward else "") + describe_signature(program, signature)
        self._collect()
        tables = []
        for plan, other in zip(base.ranks, program.ranks, strict=True):
            tables.append({
                b.id: tuple(o.meta.shape) for b, o in zip(plan.instructions, other.instructions, strict=True)
                if b.kind in (NodeKind.SEND, NodeKind.RECV) and o.meta is not None and b.meta is not None
                and tuple(o.meta.shape) != tuple(b.meta.shape)
            })
        self._gather([self._ranks.call(rank, "add_shapes", key, tables[rank]) for rank in range(program.world_size)],
                     60.0, "add_shapes")
        variants[signature] = key

    def _kind(self, forward: bool) -> tuple[Program, dict[Signature, str]]:
        """The training program and its variants, or (``forward``) those of ``load_forward``."""
        if not forward:
            return self.program, self._variants
        if self._forward is None:
            raise ExecutionError("no forward-only program: call load_forward first")
        return self._forward, self._forward_variants

    def _layouts(self, cut: BatchCut, forward: bool = False) -> list[RankLayout]:
        """Each rank's ``RankLayout`` of a batch cut into ``cut``'s pieces; ``ValueError`` for a
        piece whose shapes no variant has (``add_variant`` first)."""
        program, variants = self._kind(forward)
        missing = [s for s in cut.distinct() if s not in variants]
        if missing:
            raise ValueError(
                f"no program for batch pieces of shapes {describe_signature(program, missing[0])} (this one was "
                f"compiled for {describe_signature(program, program_signature(program))}): compile one for them "
                "and add it (Runtime.add_variant), as Trainer does"
            )
        divisors = loss_divisors(cut.sizes)
        out = []
        for rank in range(program.world_size):
            j = program.plan(rank).replica
            keys = tuple(variants[row[j]] or None for row in cut.signatures)
            out.append(RankLayout(tuple(row[j] for row in cut.sizes), tuple(row[j] for row in divisors), keys))
        return out

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
        self._forward_variants = {program_signature(program): ""}
        self._gather(self._each("load_forward", self._ranks.share(program)), 60.0, "load_forward")

    def evaluate(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> StepResult:
        """Run the program of ``load_forward`` on a whole batch, the modules in eval mode: no
        gradient, no update. ``losses``/``loss`` as for ``step``."""
        self._check_open()
        self._collect()
        program = self._forward
        if program is None:
            raise ExecutionError("no forward-only program: call load_forward first")
        inputs = compute_inputs(program.precision, inputs)
        cut = cut_batch(program, inputs, targets)
        if cut.even(program):  # the shapes it was compiled for
            shipments = _shipments(program, self._forward_names, check_batch(program, inputs, targets),
                                   self._ranks.share)
            calls = [self._ranks.call(rank, "run_forward", shipments[rank]) for rank in range(program.world_size)]
            return merge_outputs(self._gather(calls, self.step_timeout_s, "evaluate"), program, False)
        layouts = self._layouts(cut, forward=True)
        shipments = _shipments(program, self._forward_names, check_dtypes(program, inputs, targets),
                               self._ranks.share, cut.sizes)
        calls = [self._ranks.call(rank, "run_forward", shipments[rank], layouts[rank])
                 for rank in range(program.world_size)]
        outputs: list[StepOutput] = self._gather(calls, self.step_timeout_s, "evaluate")
        return merge_outputs(outputs, program, False, cut.sizes)

    def parameters(self) -> dict[str, torch.Tensor]:
        """Current parameters of every segment, by qualified name, merged over ranks (after
        every submitted step)."""
        self._check_open()
        self._collect()
        per_rank = self._gather(self._each("parameters"), 60.0, "parameters")
        shards = self._gather(self._each("parameter_shards"), 60.0, "parameters")
        return merge_parameters(self.program, per_rank, shards)

    def save_checkpoint(
        self, path: str, objects: Mapping[str, Any] | None = None, timeout_s: float = 300.0, *, wait: bool = True
    ) -> PendingSave | None:
        """Write a checkpoint into the (new, empty) directory ``path``: every rank writes
        what it holds (``piper_runtime.checkpoint``), rank 0 also ``objects`` (data by key:
        ``checkpoint_files.encode``); ``index.json`` is written last, by this process (by the
        coordinator alone under torchrun, once every rank's files are written). Not atomic by
        itself: the caller writes into a temporary directory and renames it.

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
            [self._ranks.call(rank, "checkpoint_plan", path, extra if rank == 0 else {})
             for rank in range(self.program.world_size)],
            timeout_s, "checkpoint",
        )
        plans, metadata = plan_globally(path, plans)
        refs = [self._ranks.call(rank, "checkpoint_write", plan, group="writer") for rank, plan in enumerate(plans)]
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
        self._gather(self._each("load_checkpoint", path, step, rng), timeout_s, "load checkpoint")
        self._steps = step

    def worker_pids(self) -> list[int]:
        """The process id of each rank's worker, in rank order."""
        self._check_open()
        return self._gather(self._each("ping"), 30.0, "ping")

    def shutdown(self) -> None:
        """End the ranks (leaving the process group first), or, when reusing workers, reset
        them and give them back to the pool. Safe to call more than once."""
        self._ranks.close(clean=not self._in_flight and self._writing is None)

    @property
    def closed(self) -> bool:
        return self._ranks.closed

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ExecutionError("the runtime is shut down (after shutdown() or an earlier failure)")

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
            ready = self._ranks.wait(list(pending), wait_s)
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
                    results[rank] = self._ranks.get(ref, rank)
                except RankFailure as failure:
                    self._fail(_failure_error(failure, rank, what, step))
        self._in_flight = bool(self._pending)  # submitted steps not gathered yet
        return [results[r] for r in range(len(refs))]

    def _progress(self, ranks: list[int]) -> tuple[dict[int, RankProgress], list[int]]:
        """What each of ``ranks`` says it is doing; and the ranks that did not answer within
        ``_PROGRESS_ANSWER_S`` (silent). A dead rank, or one that cannot say, is in neither:
        the step's own answer says what happened to it."""
        calls = {rank: self._ranks.call(rank, "progress", group="monitor") for rank in ranks}
        ready = self._ranks.wait(list(calls.values()), _PROGRESS_ANSWER_S, every=True)
        answered: dict[int, RankProgress] = {}
        for rank, ref in calls.items():
            if ref in ready:
                try:
                    snapshot = self._ranks.get(ref, rank)
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
        self._ranks.kill()  # end every rank: peers may be blocked in a receive from the culprit
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

    def for_rank(self, batch: Mapping[str, Any], layout: RankLayout | None = None) -> RankStep:
        """This step as a rank receives it, with ``batch``, the rank's share of it, cut as
        ``layout`` says (``None``: the program's own shapes)."""
        return RankStep(batch, self.keep_grads, self.profile, self.lr, self.memory, layout)


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
        self, runtime: Runtime, step: int, call: _Call, index: int, keep_grads: bool, lr: float | None,
        sizes: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        self.runtime = runtime
        self.sizes = sizes  # the pieces' samples of a batch cut unequally (``merge_outputs``)
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
        ready = self.runtime._ranks.wait(self.refs, 0, every=True)
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
        if self.runtime.coordinator:  # every rank's files are written: the gather was the barrier
            finish(self.path, self.metadata, results)

    def abandon(self) -> None:
        """Give the checkpoint up without waiting (the runtime failed: its ranks are gone)."""
        self.finished = True
        if self.runtime._writing is self:
            self.runtime._writing = None


def _shipments(
    program: Program,
    names: Mapping[int, Sequence[str]],
    batch: Mapping[str, torch.Tensor],
    share: Callable[[Any], Any],
    sizes: Sequence[Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """What each rank receives of a checked batch: only the batch values it reads
    (``batch_reads``), and with data parallelism only its replica's shards of them. Small
    tensors travel inline with the call (Ray stores large ones in its object store by
    itself); an explicit ``share`` (``ray.put``) pays off only for a large slice that several ranks read (an
    object-store round trip on every step). Tensors travel as ``batch.to_wire`` makes them."""
    slices: dict[tuple[str, int], torch.Tensor] = {}
    readers: dict[tuple[str, int], int] = {}
    for rank, wanted in names.items():
        replica = program.plan(rank).replica
        for n in wanted:
            key = (n, replica)
            if key not in slices:
                meta = program.value_by_name[n].meta
                slices[key] = replica_slice(batch[n], meta, program.microbatches, program.replicas, replica, sizes)
            readers[key] = readers.get(key, 0) + 1
    refs = {
        key: share(to_wire(t)) if readers[key] > 1 and t.nbytes > _INLINE_BYTES else to_wire(t)
        for key, t in slices.items()
    }
    return [
        {n: refs[(n, program.plan(rank).replica)] for n in names[rank]} for rank in range(program.world_size)
    ]


def structure_difference(program: Program, other: Program) -> str:
    """What differs between two programs apart from the shapes of values ('' when nothing):
    the same ranks, instructions (ids, kinds, segments, microbatches, values, peers,
    communicators, streams, waits, dtypes, batch dimensions and ranks of the tensors),
    segments and parameters."""
    if program.world_size != other.world_size or (program.microbatches, program.replicas) != (
        other.microbatches, other.replicas
    ):
        return (f"{other.world_size} ranks, {other.microbatches} microbatches x {other.replicas} replicas against "
                f"{program.world_size}, {program.microbatches} x {program.replicas}")
    if [s.id for s in program.segments] != [s.id for s in other.segments]:
        return "other segments"
    for a, b in zip(program.segments, other.segments, strict=True):
        if a.params != b.params or a.inputs != b.inputs or a.outputs != b.outputs:
            return f"segment {a.id} has other parameters, inputs or outputs"
    for plan, theirs in zip(program.ranks, other.ranks, strict=True):
        if len(plan.instructions) != len(theirs.instructions):
            return f"rank {plan.rank} has {len(theirs.instructions)} instructions, not {len(plan.instructions)}"
        for a, b in zip(plan.instructions, theirs.instructions, strict=True):
            kind = [(m.dtype, m.batch_dim, len(m.shape)) if m else None for m in (a.meta, b.meta)]
            if attrs.evolve(a, meta=None) != attrs.evolve(b, meta=None) or kind[0] != kind[1]:
                return f"rank {plan.rank}: instruction {a.text()} against {b.text()}"
    return ""


def _failure_error(failure: RankFailure, rank: int, what: str, step: int | None) -> ExecutionError:
    """What the driver raises for a call on ``rank`` that did not return."""
    if failure.how == "died":
        return ExecutionError(f"rank {rank} died during {what}: {failure.text}", ranks=(rank,), step=step)
    if failure.how == "silent":
        return ExecutionError(f"{what}: rank {rank} did not answer", ranks=(rank,), step=step)
    cause = failure.cause
    if isinstance(cause, PiperError):
        # An ExecutionError subclass (HangError, NumericalError) keeps its type.
        kind = type(cause) if isinstance(cause, ExecutionError) else ExecutionError
        # A call may run several steps: the worker's count says which one failed.
        failed = cause.step if what == "step" and cause.step is not None else step
        return kind(cause.message, ranks=cause.ranks or (rank,), nodes=cause.nodes, step=failed)
    err = ExecutionError(f"rank {rank} failed during {what}:\n{failure.text}", ranks=(rank,), step=step)
    err.__cause__ = cause  # what the rank raised: an OSError's errno, say (fit's restarts)
    return err
