"""What a step returns: per-rank ``StepOutput`` (from a worker) and the merged ``StepResult``."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class StepOutput:
    """One rank's share of a step.

    ``losses`` holds ``(microbatch, unscaled loss)`` pairs, only on ranks that run the loss
    segment; ``grads`` maps parameter qualified names to gradient copies when requested.
    """

    rank: int
    losses: tuple[tuple[int, float], ...] = ()
    grads: dict[str, torch.Tensor] | None = None
    timings: tuple[InstructionTiming, ...] = ()
    seconds: float = 0.0  # wall time of the step inside the worker


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
    the full batch when the loss is a mean over equal microbatches), ``grads`` the merged
    parameter gradients when ``keep_grads`` was requested."""

    losses: tuple[float, ...]
    loss: float
    grads: dict[str, torch.Tensor] | None = None
    timings: tuple[InstructionTiming, ...] = ()  # every rank's, with ``profile=True``
    worker_seconds: tuple[float, ...] = ()  # each rank's time inside its step
