"""``fit``: the training loop, a new batch per step, held-out evaluation, metrics to sinks.

The loop draws each step's batch from an iterator of ``(inputs, targets)`` (a
``BatchStream``, or a ``Prefetcher`` over one so the next batch loads while the workers run
this step), runs ``Trainer.step`` at the schedule's learning rate, and hands
``StepMetrics`` (loss, learning rate, gradient norm, step time, samples/s, tokens/s, peak
memory per rank, ETA) to each sink. It stops after ``steps`` steps of the trainer's
``TrainState`` (so a trainer restored from a checkpoint continues to the same end), after
``epochs`` epochs, or when the data ends. With ``eval_every`` it evaluates ``held_out``
after every that many steps. The batch stream is the ``TrainState``'s ``data`` while it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import attrs

from piper_train.batches import Batch
from piper_train.metrics import EvalMetrics, Sink, StepMetrics
from piper_train.trainer import Trainer


@attrs.frozen
class FitResult:
    steps: tuple[StepMetrics, ...]
    evals: tuple[EvalMetrics, ...]


def evaluate(trainer: Trainer, held_out: Callable[[int], Batch], batches: int) -> EvalMetrics:
    """The mean loss of held-out batches ``0 .. batches-1`` (forward only)."""
    if batches < 1:
        raise ValueError(f"evaluation needs at least one batch, got {batches}")
    started = time.perf_counter()
    losses = [trainer.evaluate(*held_out(k)) for k in range(batches)]
    return EvalMetrics(trainer.state.step, sum(losses) / len(losses), batches, time.perf_counter() - started)


def fit(
    trainer: Trainer,
    data: Iterator[Batch],
    *,
    steps: int | None = None,
    epochs: int | None = None,
    held_out: Callable[[int], Batch] | None = None,
    eval_every: int = 0,
    eval_batches: int = 1,
    sinks: Sequence[Sink] = (),
    profile_step: int | None = None,
) -> FitResult:
    """Train until ``steps`` steps (counted by ``trainer.state.step``) or ``epochs`` epochs
    are done, or ``data`` ends (module doc). ``data`` reports its position through
    ``state_dict()`` (``epoch``) where it has one. ``profile_step``: that step returns its
    instruction timings (``StepResult.timings``) to the sinks."""
    if steps is None and epochs is None:
        raise ValueError("fit needs steps or epochs")
    if eval_every and held_out is None:
        raise ValueError("evaluation every few steps needs held-out batches")
    state = trainer.state
    state.data = data if hasattr(data, "state_dict") else None  # type: ignore[assignment]
    total = steps if steps is not None else _epoch_steps(data, epochs)
    history: list[StepMetrics] = []
    evals: list[EvalMetrics] = []
    paces: list[float] = []
    while steps is None or state.step < steps:
        t0 = time.perf_counter()
        try:
            inputs, targets = next(data)
        except StopIteration:
            break
        epoch = _epoch(data)
        if epochs is not None and epoch >= epochs:
            break
        t1 = time.perf_counter()
        tokens_before = state.tokens
        result = trainer.step(inputs, targets, profile=state.step + 1 == profile_step)
        t2 = time.perf_counter()
        paces.append(t2 - t0)
        # The first step includes warm-up (threads, communicators): leave it out of the pace.
        pace = sum(paces[1:]) / len(paces[1:]) if len(paces) > 1 else paces[0]
        tokens = state.tokens - tokens_before
        metrics = StepMetrics(
            step=state.step,
            epoch=epoch,
            loss=result.loss,
            lr=result.lr,
            grad_norm=result.grad_norm,
            step_seconds=t2 - t1,
            data_seconds=t1 - t0,
            samples_per_s=trainer.batch_size / (t2 - t1),
            tokens_per_s=tokens / (t2 - t1) if tokens else None,
            peak_memory_bytes=tuple(m.total for m in result.memory),
            eta_seconds=pace * (total - state.step) if total is not None else None,
            total_steps=total,
        )
        history.append(metrics)
        for sink in sinks:
            sink.on_step(metrics, result)
        if eval_every and state.step % eval_every == 0 and held_out is not None:
            ev = evaluate(trainer, held_out, eval_batches)
            evals.append(ev)
            for sink in sinks:
                sink.on_eval(ev)
    return FitResult(tuple(history), tuple(evals))


def _epoch(data: object) -> int:
    state = getattr(data, "state_dict", None)
    return int(state().get("epoch", 0)) if callable(state) else 0


def _epoch_steps(data: object, epochs: int | None) -> int | None:
    """Steps in ``epochs`` epochs, when the data knows its epoch length."""
    stream = getattr(data, "stream", data)
    per_epoch = getattr(stream, "batches_per_epoch", None)
    return epochs * per_epoch if epochs is not None and per_epoch else None
