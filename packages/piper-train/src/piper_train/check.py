"""``run_check``: a strategy against single-device training on the same model and data."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import attrs
import torch

from piper_directives import Randomness, Strategy, context_degree
from piper_ir import ExecutionError, Program
from piper_runtime import TORCH_THREADS, OptimizerSpec, RunOptions
from piper_train.hf import float64_ready
from piper_train.models import Batch, ModelSpec
from piper_train.reference import ReferenceTrainer
from piper_train.schedule import LRSchedule
from piper_train.trainer import Trainer

# Default (rtol, atol) of a check per precision (``--precision``; "fp32": the model's own
# dtypes). fp32: reductions in another order differ by rounding only. bf16 keeps 8
# significant bits: a pipeline agrees exactly (the reference does the same casts on the
# workers' thread count), but a master weight that differs in its last fp32 bits after a
# data-parallel sum may round to the neighbouring bf16 value (a relative step of 2**-8),
# which moves the next step's gradients by up to a few percent of the tensor's scale;
# fp64 (``in_float64``: both sides hold, compute and update in float64) leaves summation
# order a difference near 1e-16 relative, so what passes 1e-10 is exact up to rounding and
# what fails it is a real difference; docs/precision.md has the measurements these rest on.
TOLERANCES: dict[str, tuple[float, float]] = {"fp32": (1e-5, 1e-6), "bf16": (5e-2, 1e-5), "fp64": (1e-10, 1e-12)}
# Precisions whose differences are judged per tensor (``_diff``'s ``scaled``): low ones.
SCALED = ("bf16", "bfloat16", "fp16", "float16")
# Optimizers whose update of an element is its gradient over the gradient's running scale:
# about +-lr whatever the gradient's size, so for a gradient that is rounding noise (the key
# bias of attention, which softmax cancels, has gradients of 1e-9) rounding decides the sign.
NORMALISING = ("adam", "adamw")
ADAM_EPS = 1e-8  # torch's default ``eps`` of Adam and AdamW


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
    # The first batch's loss whole against the mean of its pieces' (``_whole_batch``): not part
    # of ``ok``, which compares the strategy with single-device training on the same pieces.
    whole_batch: Difference | None = None
    # Parameter entries left out of the final comparison: gradients that stayed noise under a
    # normalising optimizer (``_Noise``).
    params_not_compared: int = 0

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


def _diff(
    what: str, where: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, scaled: bool = False,
    skip: torch.Tensor | None = None, allow: torch.Tensor | None = None,
) -> Difference:
    """``scaled``: judge against the tensor's largest entry (``max|a-b| <= atol + rtol *
    max|b|``) instead of entry by entry (``torch.allclose``): a low-precision run, where one
    weight rounding to its neighbouring bf16 value moves every entry of a gradient by an
    amount proportional to the tensor's scale, not to the entry's. ``skip``: entries left
    out (``_Noise``). ``allow``: a further tolerance per entry (``_AdamDrift``), entry by
    entry only."""
    got, want = got.double(), want.double()
    if got.shape != want.shape:
        return Difference(what, float("inf"), float("inf"), f"{where} (shape {tuple(got.shape)} vs {tuple(want.shape)})", False)
    if skip is not None:
        got, want = got[~skip], want[~skip]
        allow = allow[~skip] if allow is not None else None
    delta = (got - want).abs().max().item() if got.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    if scaled:
        ok = delta <= atol + rtol * scale
    elif allow is not None:
        ok = bool(((got - want).abs() <= atol + rtol * want.abs() + allow).all())
    else:
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
    options: RunOptions | None = None,
    log: Callable[[str], None] = lambda _: None,
    memory_budget_bytes: int | None = None,
    precision: str | None = None,
    lr_schedule: LRSchedule | None = None,
    clip_grad_norm: float | None = None,
    eval_batches: int = 0,
    **settings: Any,
) -> CheckReport:
    """Train ``steps`` steps both ways; compare every microbatch loss, every gradient (after
    clipping), the learning rate (with ``lr_schedule``) and the gradient norm (with
    ``clip_grad_norm``) of every step, after the last step every parameter and, with
    ``eval_batches``, the held-out loss of that many batches of ``workload.eval_batches``
    (forward only, in eval mode: dropout off). ``options`` and flat ``settings`` (``runtime=``,
    ``threads=``, ``seed=``, ...) as for ``Trainer``; ``precision`` too, and ``"fp64"``: both
    sides run a float64 copy of the model and data (``in_float64``): pass ``rtol, atol =
    TOLERANCES["fp64"]`` (the defaults are fp32's, as for every precision; ``piper check``
    takes the precision's). Single-device training draws the same random
    numbers and computes in the same precision (``reference_for``). Every quantity is
    compared in float64, losses and held-out losses as the Python floats both sides report."""
    options = RunOptions.build(options, **settings)
    if precision == "fp64":
        workload, precision = in_float64(workload), None  # the model's own dtypes, now float64
    seed = options.seed
    optimizer = optimizer or OptimizerSpec()
    diffs: list[Difference] = []
    norms: list[float] = []
    noise = _Noise(atol)  # entries whose gradients were noise throughout (``_Noise``)
    scaled = precision in SCALED  # low precision: differences judged per tensor (``_diff``)
    drift = _AdamDrift.of(optimizer) if not scaled else None  # what Adam makes of the gradients' differences
    with Trainer(
        workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn, strategy,
        optimizer=optimizer, options=options, memory_budget_bytes=memory_budget_bytes, log=log,
        precision=precision, lr_schedule=lr_schedule, clip_grad_norm=clip_grad_norm, regions=workload.regions,
        capture_method=workload.capture,
    ) as trainer:
        reference = reference_for(trainer, workload, optimizer, seed, lr_schedule, clip_grad_norm)
        # At no less than fp32's tolerances: the warning is about a loss that is no mean (off by
        # a factor), and a loss computed in fp32 (``.float()``, common) differs cut and whole
        # by fp32 rounding even in an fp64 check.
        loose = TOLERANCES["fp32"]
        whole = _whole_batch(reference, *workload.batches(0), max(rtol, loose[0]), max(atol, loose[1]), scaled, log)
        for step in range(steps):
            inputs, targets = workload.batches(step)
            got = trainer.step(inputs, targets, keep_grads=True)
            want = reference.step(inputs, targets)
            pairs = [("loss", f"step {step} microbatch {i}", _exact(g), _exact(w))
                     for i, (g, w) in enumerate(zip(got.losses, want.losses, strict=True))]
            if got.grads is None:
                raise RuntimeError("the runtime returned no gradients although keep_grads was set")
            _same_names(got.grads, want.grads)
            pairs += [("grad", f"step {step} {name}", got.grads[name], want.grads[name]) for name in want.grads]
            noise.add(got.grads, want.grads)
            if drift is not None:
                drift.add(got.grads, want.grads, want.lr)
            if lr_schedule is not None:
                pairs.append(("lr", f"step {step}", _exact(got.lr), _exact(want.lr)))
            if want.grad_norm is not None:
                if got.grad_norm is None:
                    raise RuntimeError("the program computed no gradient norm although clipping was asked for")
                pairs.append(("grad_norm", f"step {step}", _exact(got.grad_norm), _exact(want.grad_norm)))
                norms.append(got.grad_norm)
            diffs.extend(_diff(what, where, g, w, rtol, atol, scaled) for what, where, g, w in pairs)
            norm = f", gradient norm {got.grad_norm:.6f} (reference {want.grad_norm:.6f})" if want.grad_norm else ""
            log(f"step {step}: loss {got.loss:.6f} (reference {want.loss:.6f}), lr {got.lr:.3g}{norm}")
        params = trainer.parameters()
        quiet = noise.left_out() if optimizer.name in NORMALISING else {}
        allowed = drift.allowance() if drift is not None else {}
        diffs.extend(_diff("param", name, params[name], p, rtol, atol, scaled, quiet.get(name), allowed.get(name))
                     for name, p in reference.parameters().items())
        left_out = sum(int(q.sum()) for q in quiet.values())
        if left_out:
            log(f"{left_out} parameter entries not compared after the steps: their gradient stayed within atol "
                f"({atol:g}) of zero, and {optimizer.name} moves such an entry by up to its learning rate either "
                "way, as rounding decides (their gradients were compared)")
        for k in range(eval_batches):
            inputs, targets = workload.eval_batches(k)
            got_eval, want_eval = trainer.evaluate(inputs, targets), reference.evaluate(inputs, targets)
            diffs.append(_diff("eval", f"batch {k}", _exact(got_eval), _exact(want_eval), rtol, atol, scaled))
            log(f"held-out batch {k}: loss {got_eval:.6f} (reference {want_eval:.6f})")
    return CheckReport(steps, tuple(diffs), rtol, atol, trainer.program, tuple(norms), whole, left_out)


def _exact(value: float) -> torch.Tensor:
    """A reported number (a loss, a learning rate, a norm: a Python float) as a float64
    tensor, every bit kept: ``torch.tensor(value)`` would round it to float32 (the default
    dtype), hiding any difference below one float32 step (6e-8 relative)."""
    return torch.tensor(value, dtype=torch.float64)


def in_float64(workload: ModelSpec) -> ModelSpec:
    """``workload`` in float64 (``--precision fp64``): a private copy of the model with every
    floating parameter and buffer float64 (so the parameters are held, reduced, sharded and
    updated in float64, optimizer state too), and every batch's floating tensors, training and
    held-out, cast to float64 (integer ones, such as token ids, as they are). The caller's
    model is left as it is. A model that casts down itself (``torch.autocast``, a loss that
    calls ``.float()``) still computes those parts in its own dtypes, on both sides alike. A
    Hugging Face model takes kernels that run in float64 (``piper_train.hf.float64_ready``)."""
    model = float64_ready(copy.deepcopy(workload.model)).to(torch.float64)
    batches = _float64_batches(workload.batches)
    eval_batches = None if workload.eval_batches is None else _float64_batches(workload.eval_batches)
    inputs, targets = _float64((*workload.example_inputs,)), _float64((*workload.example_targets,))
    # ``data`` (a Dataset or loader) is the float32 source ``batches`` reads: the cast
    # ``batches`` replace it, so that ``stream()`` reads them too.
    return attrs.evolve(workload, model=model, example_inputs=inputs, example_targets=targets, batches=batches,
                        eval_batches=eval_batches, data=None, batch_size=None)


def _float64(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(torch.float64) if t.is_floating_point() else t for t in tensors)


def _float64_batches(batches: Callable[[int], Batch]) -> Callable[[int], Batch]:
    def cast(step: int) -> Batch:
        inputs, targets = batches(step)
        return _float64(inputs), _float64(targets)

    return cast


class _Noise:
    """The parameter entries whose values after the steps say nothing under a normalising
    optimizer (``NORMALISING``): those whose gradient stayed within ``atol`` of zero at every
    step on both sides (attention's key bias, which softmax cancels). Adam divides each update
    by the gradients' running scale, which is noise too there, so rounding noise moves such an
    entry by up to the learning rate at every step, by a fraction the noise decides. Their
    gradients are still compared; the other entries' parameters are, within what Adam makes of
    their gradient differences (``_AdamDrift``)."""

    def __init__(self, atol: float) -> None:
        self.atol = atol
        self.loud: dict[str, torch.Tensor] = {}  # entries with a gradient beyond atol at some step

    def add(self, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
        """One step's gradients."""
        for name, w in want.items():
            g = got[name].detach()
            if g.shape != w.shape:  # a failure ``_diff`` reports
                continue
            loud = torch.maximum(g.double().abs(), w.detach().double().abs()) > self.atol
            self.loud[name] = self.loud[name] | loud if name in self.loud else loud

    def left_out(self) -> dict[str, torch.Tensor]:
        """Per parameter, the entries not to compare."""
        return {name: ~loud for name, loud in self.loud.items()}


class _AdamDrift:
    """How far Adam's updates of each parameter entry can take the two sides apart from the
    differences of their gradients alone, which are compared entry by entry at every step.
    Adam divides each update by the gradients' running scale, so a gradient of 5e-7 that
    rounding moves by 3e-8 (within atol) moves its entry's update by 5% of the learning rate
    (``--compile``'s kernels on the ``stack`` model: docs/compile.md). Both sides' moments are
    replayed from their reported gradients, in float64, with the optimizer's betas and eps
    (torch's Adam: ``lr * m_hat / (sqrt(v_hat) + eps)``), and each step adds ``lr * |u_got -
    u_want|`` to the entry's allowance; a parameter entry then passes within ``atol + rtol *
    |p| + allowance``. Identical gradients allow nothing, so a difference of the update itself
    (a learning rate, a missing step, a wrong decay) is judged as before. Weight decay only
    shrinks a difference, and is left out. ``None`` for an optimizer this does not replay
    (SGD, which adds gradients as they are; Adam with ``amsgrad``)."""

    def __init__(self, betas: tuple[float, float], eps: float) -> None:
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.steps = 0
        self.moments: dict[str, list[torch.Tensor]] = {}  # name -> [m_got, v_got, m_want, v_want]
        self.allowed: dict[str, torch.Tensor] = {}

    @classmethod
    def of(cls, optimizer: OptimizerSpec) -> _AdamDrift | None:
        kwargs = dict(optimizer.kwargs)
        if optimizer.name not in NORMALISING or kwargs.get("amsgrad"):
            return None
        return cls(tuple(kwargs.get("betas", (0.9, 0.999))), float(kwargs.get("eps", ADAM_EPS)))

    def add(self, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], lr: float | None) -> None:
        """One step's gradients (``lr``: the step's learning rate, the reference's)."""
        self.steps += 1
        fix1, fix2 = 1 - self.beta1 ** self.steps, 1 - self.beta2 ** self.steps
        for name, w in want.items():
            g, w = got[name].detach().double(), w.detach().double()
            if g.shape != w.shape:  # a failure ``_diff`` reports
                continue
            moments = self.moments.setdefault(name, [torch.zeros_like(w) for _ in range(4)])
            updates = []
            for k, grad in ((0, g), (2, w)):
                m, v = moments[k], moments[k + 1]
                m.mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
                v.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
                updates.append((m / fix1) / ((v / fix2).sqrt() + self.eps))
            step = (lr or 0.0) * (updates[0] - updates[1]).abs()
            self.allowed[name] = self.allowed[name] + step if name in self.allowed else step

    def allowance(self) -> dict[str, torch.Tensor]:
        """Per parameter, each entry's allowance (module doc of the class)."""
        return self.allowed


def _whole_batch(
    reference: ReferenceTrainer, inputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...],
    rtol: float, atol: float, scaled: bool, log: Callable[[str], None],
) -> Difference:
    """Whether the first batch's loss run whole is the mean of its pieces' losses: what
    lets training on microbatches (and the reference, which runs them too) stand for
    training on the whole batch (``ReferenceTrainer.whole_and_pieces``). A warning, not a
    failure: a loss meant per microbatch differs on purpose."""
    whole, parts = reference.whole_and_pieces(inputs, targets)
    pieces = reference.microbatches * reference.shards
    found = _diff("batch loss", f"step 0, whole vs mean of {pieces} pieces", _exact(parts),
                  _exact(whole), rtol, atol, scaled)
    if not found.ok:
        ratio = f" ({parts / whole:.3g} times it: a sum instead of a mean?)" if whole else ""
        log(f"WARNING: the loss of the whole first batch is {whole:.6g}, the mean of its {pieces} pieces' losses "
            f"{parts:.6g}{ratio}. A step averages the losses of microbatches (and data-parallel shards), as "
            "gradient accumulation does, so loss_fn must be a mean over the batch whose value does not depend "
            "on where the batch is cut (reduction='mean', with no ignored or masked elements that vary "
            "between pieces); otherwise every strategy, and the single-device reference that runs the same "
            "pieces, trains differently from the whole batch (an auxiliary loss meant per microbatch, as "
            "Megatron computes a load-balancing loss, is the exception)")
    return found


def reference_for(
    trainer: Trainer,
    workload: ModelSpec,
    optimizer: OptimizerSpec,
    seed: int,
    lr_schedule: LRSchedule | None = None,
    clip_grad_norm: float | None = None,
) -> ReferenceTrainer:
    """Single-device training of ``workload`` that the trainer's strategy must match: the same
    microbatches, each run as the data-parallel replicas' shards, drawing the random numbers
    the captured segments draw for ``seed``, in the captured precision, on as many CPU
    threads as a worker uses (the same kernels' rounding). A context-parallel group is one
    shard: its ranks' losses are one mean over the group's whole sequences."""
    program = trainer.program
    return ReferenceTrainer(
        workload.model, workload.loss_fn, optimizer, program.microbatches,
        shards=program.replicas // context_degree(program), randomness=Randomness(seed, trainer.captured.runs, trainer.captured.regions), precision=program.precision,
        lr_schedule=lr_schedule, clip_grad_norm=clip_grad_norm, threads=TORCH_THREADS,
    )


def _same_names(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The strategy reports a gradient for exactly the parameters single-device training has
    (``ExecutionError`` naming the others: a check cannot compare what one side lacks). A
    parameter no loss depends on has no gradient on one device and a zero one after a
    data-parallel reduction: the two are the same, and the missing one is filled in."""
    for have, lack in ((got, want), (want, got)):
        for name in set(have) - set(lack):
            if not have[name].any():
                lack[name] = torch.zeros_like(have[name])
    extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    if extra or missing:
        raise ExecutionError(
            "the strategy's gradients do not name the parameters of single-device training: "
            + "; ".join(
                part for part in (
                    f"only the strategy has {extra}" if extra else "",
                    f"only single-device training has {missing}" if missing else "",
                ) if part
            )
        )
