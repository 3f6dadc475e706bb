"""The oracle: single-device training of the same model on the same data."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import attrs
import torch

from piper_runtime import OptimizerSpec


@attrs.frozen
class ReferenceStep:
    losses: tuple[float, ...]  # the loss of each microbatch, before the update
    loss: float  # their mean: the full-batch loss for a mean-reduced loss
    grads: dict[str, torch.Tensor]  # gradients of the full-batch loss


class ReferenceTrainer:
    """Plain single-device training of a private copy of ``model``.

    With ``accumulate=True`` (the default) each step runs the microbatches one after another
    and accumulates ``loss_i / microbatches`` gradients, the textbook gradient accumulation:
    mathematically the full-batch step, and summed in the same order as a pipeline, so
    results agree to rounding. ``accumulate=False`` runs one full-batch backward instead.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        optimizer: OptimizerSpec,
        microbatches: int,
        *,
        accumulate: bool = True,
    ) -> None:
        self.model = copy.deepcopy(model)
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.accumulate = accumulate
        self.optimizer = optimizer.build(self.model.parameters())

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> ReferenceStep:
        m, n_in = self.microbatches, len(inputs)
        if any(t.shape[0] % m for t in (*inputs, *targets)):
            raise ValueError(f"a batch of {inputs[0].shape[0]} samples does not split into {m} microbatches")
        chunks = list(zip(*(t.chunk(m) for t in (*inputs, *targets)), strict=True))
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        if self.accumulate:
            for chunk in chunks:
                loss = self.loss_fn(self.model(*chunk[:n_in]), *chunk[n_in:])
                (loss / m).backward()
                losses.append(float(loss.detach()))
        else:
            with torch.no_grad():
                losses = [float(self.loss_fn(self.model(*c[:n_in]), *c[n_in:])) for c in chunks]
            self.loss_fn(self.model(*inputs), *targets).backward()
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.optimizer.step()
        return ReferenceStep(tuple(losses), sum(losses) / m, grads)

    def parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}
