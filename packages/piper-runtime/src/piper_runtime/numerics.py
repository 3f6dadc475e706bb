"""Numerical faults: where a NaN or Inf first appeared, and the state to go back to.

Policies (``Runtime(on_nan=...)``, ``piper train --on-nan``):

- ``stop`` (the default): the step that produced a non-finite loss or gradient raises
  ``piper_ir.NumericalError`` naming the step and the first microbatch and rank where it
  appeared (the parameters on the workers are then those after the bad step);
- ``skip-step``: each worker keeps a copy of its parameters, parameter shards and optimizer
  state from before every step (``StateBackup``: as much memory again as that state), and a
  step found bad is undone on every rank, bit for bit, as if it had not run;
- ``continue``: the step counts; the result says what was found (``StepResult.nonfinite``).

Found where: a non-finite loss of a microbatch (on the rank that computes the loss), and a
non-finite gradient among those an optimizer is about to consume (``check_grads``, once per
optimizer instruction, after the data-parallel reductions). The loss names the microbatch;
a gradient has been summed over the microbatches by then, so it names the rank, the segment
and the parameter.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn


def nonfinite_grad(params: Iterable[nn.Parameter], names: Mapping[int, str]) -> str | None:
    """The name of the first parameter of ``params`` whose gradient holds a NaN or Inf. One
    host synchronisation when all are finite (a device backend waits once, not per tensor).

    This runs on every optimizer step, so the common case is one cheap read: a tensor whose
    float32 sum is finite holds no NaN or Inf (either would make the sum NaN or Inf). A sum
    that is not finite may still come from finite values too large to add up, so only then
    is each gradient read again exactly: a tensor holds a NaN or Inf exactly when its minimum
    or maximum is not finite, taken in float64, which holds every float dtype's values.
    Measured on the CPU with cold caches (2.1 M float32 elements in 16 tensors): the sums 0.40
    ms, ``aminmax`` 0.59-0.74 ms, ``isfinite(g).all()`` 6.4 ms."""
    with_grads = [p for p in params if p.grad is not None and p.grad.numel()]
    if not with_grads:
        return None
    if all(p.grad.is_floating_point() for p in with_grads):
        sums = torch.stack([p.grad.detach().sum(dtype=torch.float32) for p in with_grads])
        if bool(sums.isfinite().all()):
            return None
    extremes = torch.stack([e.double() for p in with_grads for e in torch.aminmax(p.grad.detach())])
    finite = extremes.isfinite().view(-1, 2).all(dim=1)
    if bool(finite.all()):
        return None
    p = with_grads[int((~finite).nonzero()[0])]
    return names.get(id(p), f"a flat shard of {p.numel()} elements")


def first_nonfinite(ranks: Sequence[tuple[int, Sequence[tuple[int, float]], Sequence[str]]]) -> str | None:
    """Where a step first went non-finite, from each rank's ``(rank, losses, grad findings)``:
    the lowest microbatch with a non-finite loss, else the lowest rank with a non-finite
    gradient; ``None`` when everything is finite."""
    losses = sorted((mb, rank, loss) for rank, per_mb, _ in ranks for mb, loss in per_mb if not math.isfinite(loss))
    if losses:
        mb, rank, loss = losses[0]
        return f"the loss of microbatch {mb} is {loss} (rank {rank})"
    for rank, _, grads in sorted(ranks):
        if grads:
            return f"a gradient is not finite on rank {rank}: {grads[0]} (losses were finite)"
    return None


class StateBackup:
    """A copy of what an optimizer step changes on one rank: every parameter (module
    parameters and flat shards), and each optimizer's state. ``restore`` copies the values
    back in place (so views into flat buffers stay views), bit for bit."""

    def __init__(self, params: Sequence[torch.Tensor], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.params = list({id(p): p for p in params}.values())
        self.optimizers = list(optimizers)
        self._saved: tuple[list[torch.Tensor], list[dict]] | None = None

    def save(self) -> None:
        with torch.no_grad():
            values = [p.detach().clone() for p in self.params]
        self._saved = (values, [copy.deepcopy(opt.state_dict()) for opt in self.optimizers])

    def restore(self) -> None:
        if self._saved is None:
            raise RuntimeError("no state was saved before this step")
        values, states = self._saved
        with torch.no_grad():
            for p, v in zip(self.params, values, strict=True):
                if p.shape == v.shape:  # a parameter freed between steps (ZeRO-3) keeps its shard
                    p.copy_(v)
        for opt, state in zip(self.optimizers, states, strict=True):
            opt.load_state_dict(copy.deepcopy(state))
            opt.zero_grad(set_to_none=True)
