"""Learning-rate schedules: a small value that builds one of torch's ``lr_scheduler``s.

The driver owns the schedule: it runs the scheduler on a stand-in optimizer
(``LearningRate``) and sends each step's learning rate with the step, so every rank's
optimizer groups use exactly the value the single-device reference's scheduler gives its
own optimizer (the same torch classes, the same arithmetic).

| name | torch schedulers | learning rate at step k (after ``warmup_steps`` W) |
| --- | --- | --- |
| ``constant`` | ``ConstantLR(factor=1)`` | ``lr`` |
| ``cosine`` | ``CosineAnnealingLR(T_max=total-W, eta_min=min_lr)`` | from ``lr`` down to ``min_lr`` at ``total_steps`` |
| ``linear`` | ``LinearLR(1 -> min_lr/lr, total-W)`` | from ``lr`` down to ``min_lr`` at ``total_steps``, then flat |
| ``step`` | ``StepLR(step_size, gamma)`` | ``lr * gamma ** ((k - W) // step_size)`` |

With W > 0 a ``LinearLR`` warm-up comes first (``SequentialLR``): step k < W uses
``lr * (k + 1) / (W + 1)`` (nanoGPT's warm-up), step W the full ``lr``.

torch is imported when a scheduler is built, so the command line can list the names without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from piper_train import bounds

if TYPE_CHECKING:
    import torch
    from torch.optim import lr_scheduler

SCHEDULES = ("constant", "cosine", "linear", "step")


@attrs.frozen
class LRSchedule:
    """Which learning-rate schedule to follow (module doc). ``total_steps`` is required by
    ``cosine`` and ``linear`` (the step at which the decay reaches ``min_lr``); ``step_size``
    by ``step``."""

    name: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr: float = 0.0
    step_size: int | None = None
    gamma: float = 0.1

    def __attrs_post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.name!r}; choose from {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warm-up steps must be >= 0, got {self.warmup_steps}")
        if self.name in ("cosine", "linear") and (self.total_steps is None or self.total_steps < 1):
            raise ValueError(f"the {self.name} schedule needs the number of steps it decays over (total_steps >= 1)")
        if self.name == "step" and (self.step_size is None or self.step_size < 1):
            raise ValueError("the step schedule needs a step size >= 1")
        bounds.check("min_lr", self.min_lr, minimum=0)
        bounds.check("gamma", self.gamma, minimum=0, strict=True)

    def build(self, optimizer: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
        """The torch scheduler of this schedule on ``optimizer`` (whose lr is the peak)."""
        from torch.optim import lr_scheduler

        base = optimizer.param_groups[0]["lr"]
        decay_steps = max(1, (self.total_steps or 0) - self.warmup_steps)
        warmup = None
        if self.warmup_steps:
            warmup = lr_scheduler.LinearLR(
                optimizer, start_factor=1.0 / (self.warmup_steps + 1), end_factor=1.0, total_iters=self.warmup_steps
            )
        main: lr_scheduler.LRScheduler
        if self.name == "cosine":
            main = lr_scheduler.CosineAnnealingLR(optimizer, T_max=decay_steps, eta_min=self.min_lr)
        elif self.name == "linear":
            end = self.min_lr / base if base else 0.0
            main = lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=end, total_iters=decay_steps)
        elif self.name == "step":
            main = lr_scheduler.StepLR(optimizer, step_size=self.step_size or 1, gamma=self.gamma)
        else:
            main = lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
        if warmup is None:
            return main
        # SequentialLR resets the learning rate and starts the warm-up afresh.
        return lr_scheduler.SequentialLR(optimizer, [warmup, main], milestones=[self.warmup_steps])


class LearningRate:
    """The driver's schedule: ``schedule`` run on a stand-in optimizer with peak ``lr``.
    ``current`` is the learning rate of the next step; ``advance`` moves past it."""

    def __init__(self, lr: float, schedule: LRSchedule | None = None) -> None:
        bounds.check("lr", lr, minimum=0)
        self.schedule = schedule or LRSchedule()
        self._optimizer = _lr_holder(lr)
        self._scheduler = self.schedule.build(self._optimizer)

    @property
    def current(self) -> float:
        return float(self._optimizer.param_groups[0]["lr"])

    def advance(self) -> None:
        self._optimizer.step()  # no gradient: a no-op that keeps the scheduler's order check happy
        self._scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self._scheduler.state_dict(), "lr": self.current}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scheduler.load_state_dict(state["scheduler"])
        for group in self._optimizer.param_groups:
            group["lr"] = state["lr"]


def _lr_holder(lr: float) -> torch.optim.Optimizer:
    """An optimizer with one parameter group, no parameters and a no-op ``step``: all torch's
    schedulers read and write. Made without ``Optimizer.__init__``, whose ``add_param_group``
    imports ``torch._dynamo`` on first use (about 2 s of the driver's start-up, for nothing:
    the driver never steps a parameter; the ranks' optimizers are the real ones)."""
    import collections

    import torch

    class LrHolder(torch.optim.Optimizer):
        def __init__(self) -> None:
            self.defaults = {"lr": lr}
            self.param_groups = [{"params": [], "lr": lr}]
            self.state = collections.defaultdict(dict)

        def step(self, closure: Any = None) -> None:
            return None

    return LrHolder()
