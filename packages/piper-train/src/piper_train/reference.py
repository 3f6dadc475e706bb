"""The oracle: single-device training of the same model on the same data."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import attrs
import torch

from piper_runtime import OptimizerSpec
from piper_train.schedule import LRSchedule


@attrs.frozen
class ReferenceStep:
    losses: tuple[float, ...]  # the loss of each microbatch, before the update
    loss: float  # their mean: the full-batch loss for a mean-reduced loss
    grads: dict[str, torch.Tensor]  # gradients of the full-batch loss (after clipping)
    grad_norm: float | None = None  # the total gradient norm before clipping, when clipping
    lr: float | None = None  # the learning rate of this step's update


class ReferenceTrainer:
    """Plain single-device training of a private copy of ``model``.

    With ``accumulate=True`` (the default) each step runs the microbatches one after another
    and accumulates ``loss_i / microbatches`` gradients, the textbook gradient accumulation:
    mathematically the full-batch step, and summed in the same order as a pipeline, so
    results agree to rounding. ``accumulate=False`` runs one full-batch backward instead.

    The training-loop basics are torch's own: the optimizer groups parameters for weight
    decay by ``OptimizerSpec.build_named``, ``lr_schedule`` builds a ``torch.optim.lr_scheduler``
    on it, stepped after each update, and ``clip_grad_norm`` clips with
    ``torch.nn.utils.clip_grad_norm_`` before the update.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        optimizer: OptimizerSpec,
        microbatches: int,
        *,
        accumulate: bool = True,
        lr_schedule: LRSchedule | None = None,
        clip_grad_norm: float | None = None,
    ) -> None:
        self.model = copy.deepcopy(model)
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.accumulate = accumulate
        self.clip_grad_norm = clip_grad_norm
        self.optimizer = optimizer.build_named(self.model.named_parameters())
        self.scheduler = (lr_schedule or LRSchedule()).build(self.optimizer)

    @torch.no_grad()
    def evaluate(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> float:
        """The loss of a batch, forward only, as the mean of its microbatches' losses."""
        m, n_in = self.microbatches, len(inputs)
        chunks = list(zip(*(t.chunk(m) for t in (*inputs, *targets)), strict=True))
        return sum(float(self.loss_fn(self.model(*c[:n_in]), *c[n_in:])) for c in chunks) / m

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
        norm = None
        if self.clip_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm))
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        return ReferenceStep(tuple(losses), sum(losses) / m, grads, norm, lr)

    def parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}
