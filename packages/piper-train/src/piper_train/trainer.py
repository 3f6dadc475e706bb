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
from piper_ir import DirectiveError, Graph, Program
from piper_memory import check_budget, plan_memory
from piper_runtime import OptimizerSpec, Runtime, StepResult
from piper_scheduler import compile_program


def pipeline_stages(graph: Graph, tag: str = "PP") -> int:
    """How many distinct ``tag`` regions the captured model has."""
    indices = {s.tags.get(tag) for s in graph.stage_segments()} - {None}
    if not indices:
        raise DirectiveError(f"the model has no annotate({tag!r}) region")
    return len(indices)


class Trainer:
    """Trains ``model`` with ``strategy`` on a local or given Ray cluster.

    ``strategy`` is a ``Strategy`` (for example ``piper_directives.one_f_one_b(2, 4)``) or a
    callable taking the number of annotated stages and returning one. The model's parameters
    are copied to the workers; ``parameters()`` returns the trained values.

    ``memory_budget_bytes``: when given, compile fails with ``MemoryPlanError`` (before any
    worker starts) if a rank's estimated memory (``piper_memory.estimate_memory``) exceeds it.
    ``threads=False`` runs each rank's plan sequentially instead of one thread per stream.
    ``seed``: what random numbers (dropout) are drawn from, per (region, microbatch, step,
    replica), so every strategy draws the same masks (``piper_runtime.randomness``);
    ``precision`` (``"bf16"``): compute in that dtype on fp32 master weights, gradients and
    optimizer state (``piper_directives.precision``). ``captured`` is the ``CapturedModel``.
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
        step_timeout_s: float = 300.0,
        memory_budget_bytes: int | None = None,
        log: Callable[[str], None] | None = None,
        threads: bool = True,
        seed: int = 0,
        precision: str | None = None,
    ) -> None:
        say = log or (lambda _: None)
        started = time.perf_counter()
        captured = capture(model, example_inputs, example_targets, loss_fn, precision=precision)
        self.captured = captured
        if not isinstance(strategy, Strategy):
            strategy = strategy(pipeline_stages(captured.graph))
        self.strategy = strategy
        # Tensor-parallel segments get their code rewritten (column/row-parallel Linears).
        graph, modules = shard_modules(strategy.apply(captured.graph), captured.modules)
        self.graph = plan_memory(graph)
        self.program: Program = compile_program(self.graph)
        optimizer = optimizer or OptimizerSpec()
        if memory_budget_bytes is not None:
            check_budget(self.program, memory_budget_bytes, optimizer.name)
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
            step_timeout_s=step_timeout_s,
            threads=threads,
            seed=seed,
            by_value=captured.user_modules,  # the model file, its neighbours: by value to the workers
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
