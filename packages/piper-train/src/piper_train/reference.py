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
    loss: float  # the full-batch loss
    grads: dict[str, torch.Tensor]  # full-batch gradients


class ReferenceTrainer:
    """Plain single-device training of a private copy of ``model``: one full-batch backward
    and one optimizer step per ``step``; microbatch losses are evaluated for comparison."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        optimizer: OptimizerSpec,
        microbatches: int,
    ) -> None:
        self.model = copy.deepcopy(model)
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.optimizer = optimizer.build(self.model.parameters())

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> ReferenceStep:
        m = self.microbatches
        with torch.no_grad():
            chunks = zip(*(t.chunk(m) for t in (*inputs, *targets)), strict=True)
            losses = tuple(
                float(self.loss_fn(self.model(*c[: len(inputs)]), *c[len(inputs) :])) for c in chunks
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(*inputs), *targets)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.optimizer.step()
        return ReferenceStep(losses, float(loss), grads)

    def parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}
