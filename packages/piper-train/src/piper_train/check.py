"""``run_check``: a strategy against single-device training on the same model and data."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from piper_directives import Strategy
from piper_ir import Program
from piper_runtime import DEFAULT_TIMEOUT_S, OptimizerSpec
from piper_train.models import ModelSpec
from piper_train.reference import ReferenceTrainer
from piper_train.trainer import Trainer


@attrs.frozen
class Difference:
    """The worst disagreement of one quantity: ``max|a-b|`` and ``max|a-b| / max|b|``;
    ``ok`` says whether it is within the check's tolerance (``torch.allclose``)."""

    what: str
    abs: float
    rel: float
    where: str
    ok: bool = True


@attrs.frozen
class CheckReport:
    steps: int
    differences: tuple[Difference, ...]
    rtol: float
    atol: float
    program: Program = attrs.field(eq=False, repr=False)

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.differences)

    def worst(self, what: str) -> Difference:
        return max((d for d in self.differences if d.what == what), key=lambda d: d.rel)

    def failures(self, limit: int = 10) -> str:
        """The quantities outside tolerance, one per line (empty when ``ok``)."""
        bad = [d for d in self.differences if not d.ok]
        lines = [f"{d.what} {d.where}: abs {d.abs:.3e} rel {d.rel:.3e}" for d in bad[:limit]]
        if len(bad) > limit:
            lines.append(f"... and {len(bad) - limit} more")
        return "\n".join(lines)


def _diff(what: str, where: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> Difference:
    got, want = got.double(), want.double()
    if got.shape != want.shape:
        return Difference(what, float("inf"), float("inf"), f"{where} (shape {tuple(got.shape)} vs {tuple(want.shape)})", False)
    delta = (got - want).abs().max().item() if got.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    ok = bool(torch.allclose(got, want, rtol=rtol, atol=atol))
    return Difference(what, delta, delta / scale if scale else delta, where, ok)


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
    memory_budget_bytes: int | None = None,
    threads: bool = True,
    backend: str | None = None,
    placement: str = "pack",
    ranks_per_gpu: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> CheckReport:
    """Train ``steps`` steps both ways; compare every microbatch loss, every gradient and,
    after the last step, every parameter. ``threads=False`` runs the plans sequentially;
    ``backend``, ``placement``, ``ranks_per_gpu``, ``timeout_s`` as for ``Trainer``."""
    optimizer = optimizer or OptimizerSpec()
    diffs: list[Difference] = []
    with Trainer(
        workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn, strategy,
        optimizer=optimizer, address=address, memory_budget_bytes=memory_budget_bytes, log=log,
        threads=threads, backend=backend, placement=placement, ranks_per_gpu=ranks_per_gpu, timeout_s=timeout_s,
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
            diffs.extend(_diff(what, where, g, w, rtol, atol) for what, where, g, w in pairs)
            log(f"step {step}: loss {got.loss:.6f} (reference {want.loss:.6f})")
        params = trainer.parameters()
        diffs.extend(_diff("param", name, params[name], p, rtol, atol) for name, p in reference.parameters().items())
    return CheckReport(steps, tuple(diffs), rtol, atol, trainer.program)
