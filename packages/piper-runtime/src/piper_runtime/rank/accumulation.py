"""Weight gradients summed over microbatches inside the matrix product that computes them.

With several microbatches, autograd computes an ``nn.Linear`` weight's gradient of each
microbatch into a new tensor and then adds it into ``.grad``: one more pass over the
weight's bytes and one allocation per microbatch. ``accumulate_in_products`` gives the
``nn.Linear`` layers of a rank's segments a backward that computes the weight gradient as
``weight.grad.addmm_(dy^T, x)`` once ``.grad`` holds the earlier microbatches' sum
(Megatron-LM's gradient accumulation fusion): the product lands in the sum, and autograd
is handed no weight gradient to add (it still runs the weight's gradient hooks after the
pass, with the sum complete). The first microbatch's gradient, and any whose ``.grad`` is
``None`` or of another dtype, shape or device, goes through autograd as before. The result is the
same sum up to rounding: ``C + A B`` in one kernel instead of ``A B`` then ``C +`` it (the
single-device oracle tests hold at their usual tolerances).

Only weights of ``MIN_WEIGHT_BYTES`` (1 MiB) or more are worth it. The saving is one pass
over the weight per microbatch; the price is a Python-level autograd function per call
(forward and backward), which a step's cold caches make cost 50-90 us on this 2-core VM.
Whole steps, 1F1B at pp=2 with 8 microbatches, fused over unfused (the slowest rank's time
inside its step, median of 4-6 alternating rounds, the rounds' range in brackets;
``benchmarks/bench_fusion.py --fusion grads --min-bytes 0``, with ``--width D,H`` for the
``stack`` model's residual blocks at other widths, 8 microbatches of 2 x 32 positions):

| model | largest weight | fused / unfused |
|---|---|---|
| ``mlp`` (d 32-64) | 16 KiB | 1.11 (1.03-1.25) |
| blocks 256, 512 | 0.5 MiB | 1.07 (1.03-1.15) |
| blocks 256, 1024 | 1 MiB | 0.96 (0.88-1.00) |
| ``stack`` (256, 1024; 4 x 32 positions per microbatch) | 1 MiB | 0.97 (0.95-1.03) |
| blocks 512, 2048 | 4 MiB | 0.91 (0.85-0.94) |
| blocks 1024, 4096 | 16 MiB | 0.89 (0.86-0.91) |

A ``Linear`` stays as it is where the fusion would be wrong:

- in a segment with a split backward (``BI`` then ``BW``): both passes run the layer's
  backward on one graph, so a backward that writes ``.grad`` itself would write it twice;
- where the weight's gradients live sharded (ZeRO-2/3): ``.grad`` is dropped after every
  pass (reduce-scattered into the shard), so there is no sum to add into;
- under ``Program.precision``: stage segments compute on cast copies of the weights, whose
  gradients autograd casts back (``RankWorker.setup`` fuses nothing then);
- a subclass with a forward of its own, or a frozen weight.

And at each call, the fused layer runs ``nn.Linear``'s own forward unless its weight is a
plain leaf tensor (not a cast copy, not a tensor subclass) and autocast is off.

**Deferred weight products.** Inside ``deferring(products)`` a fused layer's backward
computes its input gradient only and appends its weight product to ``products``
(``WeightProducts``), which ``settle`` later adds into ``.grad`` with the same kernel and
in the same order per weight, so the sums are bit for bit those of the undeferred pass. A
stage's last backward of a step, whose input gradient another rank waits for, sends it
first and computes the weight products after (``piper_runtime.rank.input_grads_first``). Which ``WeightProducts`` a backward
appends to is set per weight (``deferring(products, weights)``), process-wide rather than per
thread: on CUDA autograd runs ``backward`` on a device thread of its own. Every backward pass
of a rank runs under its gradient lock, so at most one pass of a rank defers at a time; ranks
that are threads of one process (the CUDA fakes) hold other weights, so one rank's window
never takes another's products (a single process-wide setting did: a rank's unrelated
backward then left its products in the other rank's list).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from piper_ir import Instruction, NodeKind, Phase
from piper_runtime.options import MIN_WEIGHT_BYTES

SPLIT_PHASES = (Phase.BI, Phase.BW)


def accumulate_in_products(
    modules: Mapping[str, nn.Module],
    instructions: Sequence[Instruction],
    skip: Collection[int] = (),
    min_bytes: int = MIN_WEIGHT_BYTES,
) -> int:
    """Give the fused backward (module doc) to the eligible ``nn.Linear`` layers of
    ``modules`` (segment -> module) whose weight has ``min_bytes`` or more; ``instructions``
    is the rank's plan, ``skip`` the ids of weights to leave alone. Returns how many layers
    it changed."""
    split = {ins.segment for ins in instructions if ins.kind is NodeKind.COMPUTE and ins.phase in SPLIT_PHASES}
    changed = 0
    for sid, module in modules.items():
        if sid in split:
            continue
        for layer in module.modules():
            if (
                isinstance(layer, nn.Linear)
                and type(layer).forward is nn.Linear.forward
                and layer.weight.requires_grad
                and layer.weight.nbytes >= min_bytes
                and id(layer.weight) not in skip
            ):
                # An instance attribute: ``nn.Module.__call__`` looks ``forward`` up on the instance.
                layer.forward = partial(_forward, layer)
                changed += 1
    return changed


def compiled_products(modules: Mapping[str, nn.Module], min_bytes: int, skip: Collection[int] = ()) -> list[torch.Tensor]:
    """The weights whose gradients compiled backwards add inside their matrix product
    (``piper_runtime.rank.compiled.weight_products``), by the rule ``accumulate_in_products``
    applies to eager ``nn.Linear`` layers: trainable, ``min_bytes`` or more, not in ``skip``
    (sharded gradients). Which of them a backward computes as one product, the traced graph
    says; a split backward's ``BW`` fuses too (it runs once per microbatch, as ``B`` does)."""
    return [p for module in modules.values() for p in module.parameters()
            if p.requires_grad and p.nbytes >= min_bytes and id(p) not in skip]


def has_fused_layers(module: nn.Module) -> bool:
    """Whether ``accumulate_in_products`` gave some ``nn.Linear`` of ``module`` its backward."""
    return any(_is_fused(layer) for layer in module.modules())


class WeightProducts:
    """Weight products that fused layers' backwards left for later (module doc)."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (weight, dy, x), 2-D
        # A compiled segment's weight pass, left by its ``BI`` (``piper_runtime.rank.compute``).
        self.later: list[Callable[[], None]] = []

    def __bool__(self) -> bool:
        return bool(self.pending or self.later)

    def tensors(self) -> list[torch.Tensor]:
        """What the pending products keep alive (for the memory accounting)."""
        return [t for _, dy, x in self.pending for t in (dy, x)]

    def settle(self) -> None:
        """Add every pending product into its weight's ``.grad``, in the order they came;
        call it under the rank's gradient lock."""
        pending, self.pending = self.pending, []
        later, self.later = self.later, []
        with torch.no_grad():  # a gradient, never a graph: the saved input may require grad
            for weight, dy, x in pending:
                acc = weight.grad
                if acc is None:
                    weight.grad = dy.t().mm(x)  # what autograd would have stored
                elif accumulates_into(acc, dy, weight):
                    acc.addmm_(dy.t(), x)
                else:
                    weight.grad = acc + dy.t().mm(x)
        for weight_pass in later:
            weight_pass()


_deferred: dict[int, WeightProducts] = {}  # id(weight) -> where its fused backward leaves its product now


@contextmanager
def deferring(products: WeightProducts | None, weights: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within: the fused layers of ``weights`` (``fused_weights``: a rank's) leave their
    weight products in ``products`` (``None``: they compute them as usual). Enter it under
    the rank's gradient lock (module doc)."""
    if products is None:
        yield
        return
    keys = [id(w) for w in weights]
    for key in keys:
        _deferred[key] = products
    try:
        yield
    finally:
        for key in keys:
            _deferred.pop(key, None)


def fused_weights(modules: Mapping[str, nn.Module]) -> list[torch.Tensor]:
    """The weights of the layers of ``modules`` that ``accumulate_in_products`` fused."""
    return [layer.weight for module in modules.values() for layer in module.modules() if _is_fused(layer)]


def _is_fused(layer: nn.Module) -> bool:
    return isinstance(f := layer.__dict__.get("forward"), partial) and f.func is _forward


def describe_fusion(layers: Mapping[int, int], min_bytes: int | None, input_grads_first: bool = False) -> str:
    """One line for the run's log: how many layers each rank fused (``accumulate_in_products``)
    and, with ``input_grads_first``, that a stage's last backward sends before adding them."""
    shown = ", ".join(f"rank {r}: {n}" for r, n in sorted(layers.items()))
    first = ("; a stage's last backward sends its input gradient before adding them (input_grads_first)"
             if input_grads_first else "")
    return (
        f"gradients: {sum(layers.values())} nn.Linear layers with weights of {min_bytes or 0:,} bytes or more add "
        f"each microbatch's weight gradient inside its matrix product ({shown}){first}"
    )


def _forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = layer.weight, layer.bias
    if (
        type(weight) is not nn.Parameter
        or not weight.is_leaf
        or not torch.is_grad_enabled()
        or torch.is_autocast_enabled(x.device.type)
        or x.dtype != weight.dtype
    ):
        return F.linear(x, weight, bias)
    return _LinearAccumulating.apply(x, weight, bias)


class _LinearAccumulating(torch.autograd.Function):
    """``F.linear`` whose weight gradient is added into ``weight.grad`` by the product itself
    where ``.grad`` already exists (module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad_out.matmul(weight) if need_x else None
        grad_w = grad_b = None
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        if need_w:
            flat_x = x.reshape(-1, x.shape[-1])
            acc = weight.grad
            deferred = _deferred.get(id(weight))
            if deferred is not None:
                deferred.pending.append((weight, dy, flat_x))  # ``WeightProducts.settle`` adds it
            elif acc is not None and accumulates_into(acc, dy, weight):
                acc.addmm_(dy.t(), flat_x)  # into the sum; autograd accumulates nothing
            else:
                grad_w = dy.t().mm(flat_x)
        if need_b and ctx.has_bias:
            grad_b = dy.sum(0)
        return grad_x, grad_w, grad_b


def accumulates_into(acc: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product (of ``dy``'s dtype and device) may be added into ``acc``, ``weight``'s
    gradient, in place (else a new sum; a compiled segment's products too: ``WeightProduct``)."""
    return (
        acc.dtype == dy.dtype
        and acc.device == dy.device
        and acc.shape == weight.shape
        and acc.is_contiguous()
        and not acc.requires_grad
    )
