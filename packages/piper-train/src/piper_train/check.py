"""``run_check``: a strategy against single-device training on the same model and data."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from piper_directives import Strategy
from piper_ir import Program
from piper_runtime import OptimizerSpec
from piper_train.models import ModelSpec
from piper_train.reference import ReferenceTrainer
from piper_train.schedule import LRSchedule
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
    grad_norms: tuple[float, ...] = ()  # the strategy's gradient norm of each step, when clipping

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
    lr_schedule: LRSchedule | None = None,
    clip_grad_norm: float | None = None,
    eval_batches: int = 0,
) -> CheckReport:
    """Train ``steps`` steps both ways; compare every microbatch loss, every gradient (after
    clipping), the learning rate (with ``lr_schedule``) and the gradient norm (with
    ``clip_grad_norm``) of every step, after the last step every parameter and, with
    ``eval_batches``, the held-out loss of that many batches of ``workload.eval_batches``
    (forward only). ``threads=False`` runs the plans sequentially; ``backend``,
    ``placement``, ``ranks_per_gpu`` as for ``Trainer``."""
    optimizer = optimizer or OptimizerSpec()
    diffs: list[Difference] = []
    norms: list[float] = []
    with Trainer(
        workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn, strategy,
        optimizer=optimizer, address=address, memory_budget_bytes=memory_budget_bytes, log=log,
        threads=threads, backend=backend, placement=placement, ranks_per_gpu=ranks_per_gpu,
        lr_schedule=lr_schedule, clip_grad_norm=clip_grad_norm,
    ) as trainer:
        reference = ReferenceTrainer(
            workload.model, workload.loss_fn, optimizer, trainer.program.microbatches,
            lr_schedule=lr_schedule, clip_grad_norm=clip_grad_norm,
        )
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
            if lr_schedule is not None:
                pairs.append(("lr", f"step {step}", torch.tensor(got.lr), torch.tensor(want.lr)))
            if want.grad_norm is not None:
                if got.grad_norm is None:
                    raise RuntimeError("the program computed no gradient norm although clipping was asked for")
                pairs.append(("grad_norm", f"step {step}", torch.tensor(got.grad_norm), torch.tensor(want.grad_norm)))
                norms.append(got.grad_norm)
            diffs.extend(_diff(what, where, g, w, rtol, atol) for what, where, g, w in pairs)
            norm = f", gradient norm {got.grad_norm:.6f} (reference {want.grad_norm:.6f})" if want.grad_norm else ""
            log(f"step {step}: loss {got.loss:.6f} (reference {want.loss:.6f}), lr {got.lr:.3g}{norm}")
        params = trainer.parameters()
        diffs.extend(_diff("param", name, params[name], p, rtol, atol) for name, p in reference.parameters().items())
        for k in range(eval_batches):
            inputs, targets = workload.eval_batches(k)
            got_eval, want_eval = trainer.evaluate(inputs, targets), reference.evaluate(inputs, targets)
            diffs.append(_diff("eval", f"batch {k}", torch.tensor(got_eval), torch.tensor(want_eval), rtol, atol))
            log(f"held-out batch {k}: loss {got_eval:.6f} (reference {want_eval:.6f})")
    return CheckReport(steps, tuple(diffs), rtol, atol, trainer.program, tuple(norms))
