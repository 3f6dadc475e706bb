"""What a rank is asked to step (``RankStep``) and what a step returns: per-rank ``StepOutput``
(from a worker) and the merged ``StepResult``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from piper_runtime.rank.memory import RankMemory


@attrs.frozen
class RankStep:
    """One training step as a rank receives it: ``batch`` maps the batch values the rank reads
    to whole-batch tensors (or Ray object refs to them); ``keep_grads`` returns gradient
    copies; ``profile`` records when each instruction started and ended; ``lr`` is the
    learning rate of this step's updates (``None``: the one of the step before); ``memory``
    accounts the rank's memory over the step, at a cost per instruction; ``layout``: how a
    batch of other shapes than the program's is cut (``None``: the program's own shapes)."""

    batch: Mapping[str, Any]
    keep_grads: bool = False
    profile: bool = False
    lr: float | None = None
    memory: bool = False
    layout: RankLayout | None = None


@attrs.frozen
class StepOutput:
    """One rank's share of a step.

    ``losses`` holds ``(microbatch, unscaled loss)`` pairs, only on ranks that run the loss
    segment; ``grads`` maps parameter qualified names to gradient copies when requested, for
    parameters whose gradients are whole on this rank; ``grad_shards`` maps the id of each
    bucket whose gradients are sharded (ZeRO >= 1) to ``(replica, this replica's shard of the
    reduced flat gradient)``; ``memory`` is the rank's peak memory over the step.
    """

    rank: int
    losses: tuple[tuple[int, float], ...] = ()
    grads: dict[str, torch.Tensor] | None = None
    timings: tuple[InstructionTiming, ...] = ()
    seconds: float = 0.0  # wall time of the step inside the worker
    grad_shards: dict[str, tuple[int, torch.Tensor]] | None = None
    memory: RankMemory | None = None
    collective_seconds: float = 0.0  # inside the collectives that compute issues (TP, EP)
    grad_norm: float | None = None  # the global gradient norm, where the plan computes it
    nonfinite: tuple[str, ...] = ()  # gradients found NaN/Inf before an optimizer step
    # ``time.perf_counter()`` when the step began in the worker: the origin of ``timings``.
    # On Linux that clock is CLOCK_MONOTONIC, one clock for every process of a host, so the
    # ranks of one host can be put on one time line (``StepResult.worker_started``).
    started: float = 0.0
    # torch.profiler's Chrome trace (JSON text) of a profiled step, when the run records one
    # (``ExecutionOptions.profile_kernels``); None on the ranks of a process whose trace
    # another rank returns (piper_runtime.rank.kernel_profile).
    kernel_trace: str | None = None
    # ``memory_snapshot``: (seconds since ``started``, bytes per category in
    # ``piper_runtime.rank.memory.CATEGORIES`` order) after each instruction, and on a GPU the
    # CUDA memory history snapshot as JSON text (piper_runtime.rank.memory_snapshot).
    memory_timeline: tuple[tuple[float, tuple[int, ...]], ...] = ()
    cuda_snapshot: str | None = None
    # Seconds this rank spent compiling segments during the step (``ExecutionOptions.compile``:
    # a segment compiles on the first step that runs it, and on the first of a new shape).
    compile_seconds: float = 0.0


@attrs.frozen
class InstructionTiming:
    """When one instruction ran on its rank, in seconds from the start of the worker's step
    (``profile=True``). A receive's time includes waiting for its sender."""

    rank: int
    instruction: str
    start: float
    end: float


@attrs.frozen
class StepResult:
    """A whole step: ``losses[i]`` is microbatch i's loss, ``loss`` their mean (the loss of
    the full batch when the loss is a mean over equal microbatches; with data parallelism,
    the mean over replicas of their shard losses), ``grads`` the merged full parameter
    gradients (summed over replicas, sharded ones reassembled) when ``keep_grads`` was
    requested, ``memory`` each rank's peak memory by category (in rank order), ``grad_norm``
    the global gradient norm before clipping (where the program has a ``GRAD_NORM``), ``lr``
    the learning rate the step used (where the caller set one)."""

    losses: tuple[float, ...]
    loss: float
    grads: dict[str, torch.Tensor] | None = None
    timings: tuple[InstructionTiming, ...] = ()  # every rank's, with ``profile=True``
    worker_seconds: tuple[float, ...] = ()  # each rank's time inside its step
    memory: tuple[RankMemory, ...] = ()
    # Each rank's time inside the tensor- and expert-parallel collectives of its compute.
    collective_seconds: tuple[float, ...] = ()
    grad_norm: float | None = None
    lr: float | None = None
    # Each rank's seconds compiling segments during the step (``StepOutput.compile_seconds``).
    compile_seconds: tuple[float, ...] = ()
    # Where a NaN/Inf loss or gradient first appeared in this step (``piper_runtime.numerics``),
    # and whether the step was undone for it (``on_nan="skip-step"``).
    nonfinite: str | None = None
    skipped: bool = False
    worker_started: tuple[float, ...] = ()  # each rank's ``StepOutput.started``
    # (rank, torch.profiler Chrome trace JSON) of each process that recorded one
    kernel_traces: tuple[tuple[int, str], ...] = ()
    # (rank, its ``StepOutput.memory_timeline``) and (rank, its CUDA snapshot JSON) of a
    # profiled step under ``ExecutionOptions.memory_snapshot``
    memory_timelines: tuple[tuple[int, tuple[tuple[float, tuple[int, ...]], ...]], ...] = ()
    cuda_snapshots: tuple[tuple[int, str], ...] = ()


@attrs.frozen
class RankLayout:
    """How a rank's share of a batch that is not the program's own is cut (``Runtime``:
    ``piper_runtime.batch.BatchCut``), per microbatch of the rank's replica: ``sizes``, its
    samples; ``divisors``, what its loss is divided by for backward (the batch's samples over
    the piece's: ``batch.loss_divisors``); ``shapes``, the key of the shape table its
    transfers take their shapes from (``RankWorker.add_shapes``; ``None``: the program's own)."""

    sizes: tuple[int, ...]
    divisors: tuple[float, ...]
    shapes: tuple[str | None, ...]
