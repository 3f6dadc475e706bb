"""The front door: one call from (model, example batch, loss, strategy) to a running trainer.

``Trainer`` composes the packages: capture (piper-directives) -> strategy -> tensor-parallel
rewrite of sharded segments' code (``shard_modules``) -> memory planning
(piper-memory: ZeRO reductions, gathers and frees) -> compile and verify (piper-scheduler)
-> execute on Ray (piper-runtime). Everything in between is a
``piper_ir`` value, available as ``trainer.graph`` and ``trainer.program``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from piper_directives import Strategy, build_schedule, capture, shard_modules
from piper_directives.capturing import CapturedModel, tie_locations
from piper_ir import DirectiveError, Graph, Program
from piper_memory import check_budget, plan_memory
from piper_runtime import DEFAULT_TIMEOUT_S, OptimizerSpec, Runtime, StepResult, WorkerPool
from piper_scheduler import compile_program
from piper_train.user_code import ship_by_value


def pipeline_stages(graph: Graph, tag: str = "PP") -> int:
    """How many distinct ``tag`` regions the captured model has."""
    indices = {s.tags.get(tag) for s in graph.stage_segments()} - {None}
    if not indices:
        raise DirectiveError(f"the model has no annotate({tag!r}) region")
    return len(indices)


def refuse_unsupported(captured: CapturedModel) -> None:
    """Refuse what capture records but the runtime does not carry out yet, rather than train
    a different model: tied parameters (each holder would train its own copy)."""
    if captured.graph.ties:
        tie = captured.graph.ties[0]
        raise DirectiveError(
            f"parameter {tie.name!r} is tied (one tensor used by several regions): {tie_locations(captured, tie)}. "
            "The runtime does not sum tied gradients over their holders yet, so each would train its own "
            "copy; untie them in the model (give each region its own parameter) to train it with Piper."
        )


class Trainer:
    """Trains ``model`` with ``strategy`` on a local or given Ray cluster.

    ``strategy`` is a ``Strategy`` (for example ``piper_directives.one_f_one_b(2, 4)``) or a
    callable taking the number of annotated stages and returning one. The model's parameters
    are copied to the workers; ``parameters()`` returns the trained values.

    ``memory_budget_bytes``: when given, compile fails with ``MemoryPlanError`` (before any
    worker starts) if a rank's estimated memory (``piper_memory.estimate_memory``) exceeds it;
    it is per GPU, so with ``ranks_per_gpu`` N each rank may use 1/N of it.
    ``threads=False`` runs each rank's plan sequentially instead of one thread per stream.

    ``backend``: ``"cpu"``, ``"cuda"``, or ``None`` to choose: ``cuda`` when the Ray cluster has
    a GPU for every rank (a share of one with ``ranks_per_gpu``) and the CUDA backend can run
    there, else ``cpu``; the choice and why go to ``log``. ``placement``: ``"pack"`` (ranks on
    as few nodes as possible) or ``"spread"`` (``piper_runtime.placement``).
    ``timeout_s``: a rank that makes no progress for this long fails the step with
    ``piper_ir.HangError`` naming it, its instruction and what its peers were doing;
    ``step_timeout_s`` (default: none) also bounds a whole step. ``on_nan``: ``"stop"``
    (``piper_ir.NumericalError`` at the first NaN/Inf loss or gradient), ``"skip-step"`` (undo
    that step: parameters and optimizer state exactly as before it) or ``"continue"``
    (``piper_runtime.numerics``; ``StepResult.nonfinite`` and ``skipped`` say what happened). ``reuse_workers`` is ``Runtime``'s: ``True`` (or a ``piper_runtime.WorkerPool``) takes the
    Ray workers from a pool and gives them back at ``close``; ``None`` follows
    ``PIPER_REUSE_WORKERS``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        example_inputs: Sequence[torch.Tensor],
        example_targets: Sequence[torch.Tensor],
        loss_fn: Callable[..., torch.Tensor],
        strategy: Strategy | Callable[[int], Strategy],
        *,
        optimizer: OptimizerSpec | None = None,
        address: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        step_timeout_s: float | None = None,
        on_nan: str = "stop",
        memory_budget_bytes: int | None = None,
        log: Callable[[str], None] | None = None,
        threads: bool = True,
        backend: str | None = None,
        placement: str = "pack",
        ranks_per_gpu: int = 1,
        reuse_workers: bool | WorkerPool | None = None,
    ) -> None:
        say = log or (lambda _: None)
        started = time.perf_counter()
        captured = capture(model, example_inputs, example_targets, loss_fn)
        refuse_unsupported(captured)
        ship_by_value(captured.user_modules)  # the model file, its neighbours: by value to the workers
        recompute = [s.id for s in captured.graph.stage_segments() if s.recompute]
        if recompute:
            say(f"regions {', '.join(recompute)} call torch.utils.checkpoint; this runtime keeps their "
                "activations instead of recomputing them (same gradients, more memory)")
        if not isinstance(strategy, Strategy):
            strategy = strategy(pipeline_stages(captured.graph))
        self.strategy = strategy
        # Tensor-parallel segments get their code rewritten (column/row-parallel Linears).
        graph, modules = shard_modules(strategy.apply(captured.graph), captured.modules)
        self.graph = plan_memory(graph)
        self.program: Program = compile_program(self.graph)
        optimizer = optimizer or OptimizerSpec()
        if memory_budget_bytes is not None:
            check_budget(self.program, memory_budget_bytes // max(1, ranks_per_gpu), optimizer.name)
        self.compile_seconds = time.perf_counter() - started
        self.batch_size = captured.batch_size
        say(
            f"captured {len(self.graph.stage_segments())} regions, compiled and verified "
            f"{self.program.world_size} rank plans in {self.compile_seconds:.2f} s; "
            f"starting {self.program.world_size} Ray workers"
        )
        self.runtime = Runtime(
            self.program,
            modules,
            optimizer=optimizer,
            address=address,
            timeout_s=timeout_s,
            step_timeout_s=step_timeout_s,
            on_nan=on_nan,
            threads=threads,
            backend=backend,
            placement=placement,
            ranks_per_gpu=ranks_per_gpu,
            log=say,
            reuse_workers=reuse_workers,
        )

    @classmethod
    def with_schedule(
        cls,
        model: torch.nn.Module,
        example_inputs: Sequence[torch.Tensor],
        example_targets: Sequence[torch.Tensor],
        loss_fn: Callable[..., torch.Tensor],
        *,
        schedule: str,
        pp: int,
        microbatches: int,
        dp: int = 1,
        zero: int = 0,
        tp: int = 1,
        ep: int = 1,
        **kwargs: object,
    ) -> Trainer:
        """A trainer running a named schedule from the library over ``pp`` pipeline ranks,
        replicated ``dp`` times with ZeRO level ``zero``, each stage tensor-parallel over
        ``tp`` or expert-parallel over ``ep`` devices (``pp * dp * tp * ep`` devices; the
        layout is ``piper_directives.parallelize``'s), with as many regions as the model has."""

        def strategy(stages: int) -> Strategy:
            return build_schedule(schedule, pp, microbatches, stages=stages, dp=dp, zero=zero, tp=tp, ep=ep)

        return cls(model, example_inputs, example_targets, loss_fn, strategy, **kwargs)  # type: ignore[arg-type]

    def step(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        *,
        keep_grads: bool = False,
        profile: bool = False,
    ) -> StepResult:
        """One training step on a full batch; returns the per-microbatch losses (and, when
        asked, the gradients and per-instruction timings)."""
        return self.runtime.step(tuple(inputs), tuple(targets), keep_grads=keep_grads, profile=profile)

    def parameters(self) -> dict[str, torch.Tensor]:
        return self.runtime.parameters()

    def close(self) -> None:
        self.runtime.shutdown()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
