"""``run_check``: a strategy against single-device training on the same model and data."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from piper_directives import Strategy
from piper_runtime import OptimizerSpec
from piper_train.models import ModelSpec
from piper_train.reference import ReferenceTrainer
from piper_train.trainer import Trainer


@attrs.frozen
class Difference:
    """The worst disagreement of one quantity: ``max|a-b|`` and ``max|a-b| / max|b|``."""

    what: str
    abs: float
    rel: float
    where: str


@attrs.frozen
class CheckReport:
    steps: int
    differences: tuple[Difference, ...]
    ok: bool
    rtol: float
    atol: float

    def worst(self, what: str) -> Difference:
        return max((d for d in self.differences if d.what == what), key=lambda d: d.rel)


def _diff(what: str, where: str, got: torch.Tensor, want: torch.Tensor) -> Difference:
    delta = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = want.double().abs().max().item() if want.numel() else 0.0
    return Difference(what, delta, delta / scale if scale else delta, where)


def run_check(
    workload: ModelSpec,
    strategy: Strategy | Callable[[int], Strategy],
    *,
    steps: int = 3,
    optimizer: OptimizerSpec | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    address: str | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> CheckReport:
    """Train ``steps`` steps both ways; compare every microbatch loss, every gradient and,
    after the last step, every parameter."""
    optimizer = optimizer or OptimizerSpec()
    diffs: list[Difference] = []
    ok = True
    with Trainer(
        workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn, strategy,
        optimizer=optimizer, address=address,
    ) as trainer:
        reference = ReferenceTrainer(workload.model, workload.loss_fn, optimizer, trainer.program.microbatches)
        for step in range(steps):
            inputs, targets = workload.batches(step)
            got = trainer.step(inputs, targets, keep_grads=True)
            want = reference.step(inputs, targets)
            pairs = [("loss", f"step {step} microbatch {i}", torch.tensor(g), torch.tensor(w))
                     for i, (g, w) in enumerate(zip(got.losses, want.losses, strict=True))]
            if got.grads is None:
                raise RuntimeError("the runtime returned no gradients although keep_grads was set")
            if set(got.grads) != set(want.grads):
                raise AssertionError(f"gradient names differ: {sorted(set(got.grads) ^ set(want.grads))}")
            pairs += [("grad", f"step {step} {name}", got.grads[name], want.grads[name]) for name in want.grads]
            for what, where, g, w in pairs:
                diffs.append(_diff(what, where, g, w))
                ok &= torch.allclose(g.double(), w.double(), rtol=rtol, atol=atol)
            log(f"step {step}: loss {got.loss:.6f} (reference {want.loss:.6f})")
        params = trainer.parameters()
        for name, want_p in reference.parameters().items():
            diffs.append(_diff("param", name, params[name], want_p))
            ok &= torch.allclose(params[name].double(), want_p.double(), rtol=rtol, atol=atol)
    return CheckReport(steps, tuple(diffs), bool(ok), rtol, atol)
