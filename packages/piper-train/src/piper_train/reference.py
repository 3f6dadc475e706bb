"""The oracle: single-device training of the same model on the same data."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence

import attrs
import torch

from piper_directives import PrecisionModel, Randomness, Tensors, as_tensors
from piper_ir import Precision
from piper_runtime import OptimizerSpec, loss_divisors, piece_sizes, weighted_losses
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

    ``shards``: each microbatch runs as that many equal pieces along dim 0 (what ``shards``
    data-parallel replicas compute), the loss of each scaled by ``1 / (microbatches *
    shards)``; the loss of a microbatch is the mean of its pieces'. Mathematically the same
    step, but it draws random numbers the way the replicas do.

    A batch of any size and shape steps (a batch of another sequence length, an epoch's last
    partial batch): one that does not divide evenly is cut as the runtime cuts it
    (``piper_runtime.batch.piece_sizes``: the first pieces a sample larger), each piece's loss
    divided by the batch's samples over its own, and the losses reported are means weighted
    by samples (``weighted_losses``), as ``Trainer.step`` reports them.

    ``randomness``: draw the random numbers a captured model's segments draw
    (piper_directives.randomness): the regions of step ``k`` (counted from 0 by this
    trainer), microbatch ``i``, piece ``j`` reseed at the boundaries where segments start,
    the loss under the loss segment's key. Dropout then gives the masks every strategy
    gives.

    ``precision``: run the model as the captured segments run with that ``Precision``
    (piper_directives.precision.PrecisionModel): fp32 master weights, compute in the low dtype.

    ``threads``: run each step with torch using that many CPU threads (restored afterwards).
    A CPU kernel may split a reduction differently over another thread count (a matmul's
    blocking), so its results differ in the last bits; in bf16, where a last-bit difference
    can round a value to its neighbour (2**-8 apart), that shows. ``run_check`` passes the
    runtime workers' count (one), so the reference does the workers' arithmetic.

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
        shards: int = 1,
        randomness: Randomness | None = None,
        precision: Precision | None = None,
        lr_schedule: LRSchedule | None = None,
        clip_grad_norm: float | None = None,
        threads: int | None = None,
    ) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if not accumulate and (shards > 1 or randomness is not None):
            raise ValueError("a full-batch step (accumulate=False) cannot run pieces or draw per-microbatch randomness")
        self.model = copy.deepcopy(model)
        self.forward = PrecisionModel(self.model, precision) if precision is not None else self.model
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.accumulate = accumulate
        self.shards = shards
        self.randomness = randomness
        if randomness is not None:
            randomness.install(self.model)  # regions named by module path cross their boundaries
        self.steps = 0
        self.threads = threads
        self.clip_grad_norm = clip_grad_norm
        self.optimizer = optimizer.build_named(self.model.named_parameters())
        self.scheduler = (lr_schedule or LRSchedule()).build(self.optimizer)

    def evaluate(self, inputs: Tensors, targets: Tensors) -> float:
        """The loss of a batch, forward only and in eval mode, as the mean of its
        microbatches' losses (what ``Trainer.evaluate`` reports)."""
        with _torch_threads(self.threads), torch.no_grad():
            return self._evaluate(as_tensors(inputs), as_tensors(targets))

    def whole_and_pieces(self, inputs: Tensors, targets: Tensors) -> tuple[float, float]:
        """The loss of the batch run whole, and the mean of the losses of the pieces a step
        cuts it into (microbatches x data-parallel shards), forward only in eval mode
        (dropout off: the same function both ways). Equal for a loss that is a mean over the
        batch; a sum, or a mean over a count that varies between pieces (ignored or masked
        elements), makes them differ, and training on pieces then differs from training on
        the whole batch."""
        pieces = self.microbatches * self.shards
        inputs, targets = as_tensors(inputs), as_tensors(targets)
        n_in = len(inputs)
        with _torch_threads(self.threads), torch.no_grad():
            self.model.eval()
            try:
                whole = float(self._loss(self.forward(*inputs), targets))
                cut = list(zip(*(t.tensor_split(pieces) for t in (*inputs, *targets)), strict=True))
                parts = sum(float(self._loss(self.forward(*c[:n_in]), c[n_in:])) for c in cut) / pieces
            finally:
                self.model.train()
        return whole, parts

    def _evaluate(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> float:
        m, n_in = self.microbatches, len(inputs)
        samples = inputs[0].shape[0]
        if samples % m == 0:
            chunks = list(zip(*(t.chunk(m) for t in (*inputs, *targets)), strict=True))
        else:  # a batch that does not divide evenly: cut as a step cuts it, weighted by samples
            sizes = [sum(row) for row in piece_sizes(samples, m)]
            chunks = list(zip(*(t.split(sizes) for t in (*inputs, *targets)), strict=True))
        self.model.eval()
        try:
            losses = [float(self._loss(self.forward(*c[:n_in]), c[n_in:])) for c in chunks]
        finally:
            self.model.train()
        if samples % m == 0:
            return sum(losses) / m
        return sum(n * v for n, v in zip(sizes, losses, strict=True)) / samples

    def step(self, inputs: Tensors, targets: Tensors) -> ReferenceStep:
        """One step on a batch (a tensor or a tuple of tensors each, as ``Trainer.step``)."""
        with _torch_threads(self.threads):
            return self._step(as_tensors(inputs), as_tensors(targets))

    def _step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> ReferenceStep:
        m, n_in = self.microbatches, len(inputs)
        samples = inputs[0].shape[0]
        if samples < m * self.shards or any(t.shape[0] != samples for t in (*inputs, *targets)):
            pieces = f"{m} microbatches" + (f" of {self.shards} shards" if self.shards > 1 else "")
            raise ValueError(f"a batch of {samples} samples does not split into {pieces} of a sample or more")
        # The pieces a program cuts the batch into (``piper_runtime.batch``): equal ones, or,
        # for a batch that does not divide evenly, some a sample larger, each loss divided by
        # the batch's samples over the piece's, so the step is the whole batch's mean.
        sizes = piece_sizes(samples, m, self.shards)
        divisors = loss_divisors(sizes)
        even = samples % (m * self.shards) == 0
        chunks = list(zip(*(t.split([sum(row) for row in sizes]) for t in (*inputs, *targets)), strict=True))
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        piece_losses = []
        if self.accumulate:
            for i, chunk in enumerate(chunks):
                pieces = list(zip(*(t.split(list(sizes[i])) for t in chunk), strict=True))
                shard_losses = [self._backward(piece[:n_in], piece[n_in:], i, j, divisors[i][j])
                                for j, piece in enumerate(pieces)]
                piece_losses.append(shard_losses)
                losses.append(sum(shard_losses) / self.shards)
        else:
            with torch.no_grad():
                losses = [float(self._loss(self.forward(*c[:n_in]), c[n_in:])) for c in chunks]
            self._loss(self.forward(*inputs), targets).backward()
        norm = None
        if self.clip_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm))
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.steps += 1
        if not even and self.accumulate:
            weighted, loss = weighted_losses(piece_losses, sizes)
            return ReferenceStep(weighted, loss, grads, norm, lr)
        if not even:  # the microbatches' losses weighted by their samples: the whole batch's mean
            loss = sum(sum(row) * v for v, row in zip(losses, sizes, strict=True)) / samples
            return ReferenceStep(tuple(losses), loss, grads, norm, lr)
        return ReferenceStep(tuple(losses), sum(losses) / m, grads, norm, lr)

    def _backward(
        self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], microbatch: int, shard: int,
        divisor: float | None = None,
    ) -> float:
        """Forward and backward of one piece of one microbatch, its loss divided by ``divisor``
        (default: microbatches x shards, the pieces of a batch that divides evenly); returns
        its loss."""
        r = self.randomness
        with r.regions(microbatch, self.steps, shard) if r else contextlib.nullcontext():
            outputs = self.forward(*inputs)
        with r.loss(microbatch, self.steps, shard) if r else contextlib.nullcontext():
            loss = self._loss(outputs, targets)
        (loss / (self.microbatches * self.shards if divisor is None else divisor)).backward()
        return float(loss.detach())

    def _loss(self, outputs: torch.Tensor | Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor:
        """``loss_fn(*outputs, *targets)``, as the captured loss segment calls it."""
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        return self.loss_fn(*outputs, *targets)

    def parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


@contextlib.contextmanager
def _torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` (``None``: unchanged) for the body."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
