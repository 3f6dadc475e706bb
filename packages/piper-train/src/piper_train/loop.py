"""``fit``: the training loop, a new batch per step, held-out evaluation, metrics to sinks.

The loop draws each step's batch from an iterator of ``(inputs, targets)`` (a
``BatchStream``, or a ``Prefetcher`` over one so the next batch loads while the workers run
this step), runs ``Trainer.step`` at the schedule's learning rate, and hands
``StepMetrics`` (loss, learning rate, gradient norm, step time, samples/s, tokens/s, peak
memory per rank, ETA) to each sink; the next step is sent while this one computes
(``Trainer.submit``). It stops after ``steps`` steps of the trainer's
``TrainState`` (so a trainer restored from a checkpoint continues to the same end), after
``epochs`` epochs, or when the data ends. With ``eval_every`` it evaluates ``held_out``
after every that many steps. The batch stream is the ``TrainState``'s ``data`` while it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import attrs

from piper_runtime import PendingStep
from piper_train.batches import Batch
from piper_train.metrics import EvalMetrics, Sink, StepMetrics
from piper_train.trainer import Trainer

MEMORY_EVERY = 100  # fit accounts memory on steps 1, 2 and every this many


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
    memory_every: int = MEMORY_EVERY,
) -> FitResult:
    """Train until ``steps`` steps (counted by ``trainer.state.step``) or ``epochs`` epochs
    are done, or ``data`` ends (module doc). ``data`` reports its position through
    ``state_dict()`` (``epoch``) where it has one. ``profile_step``: that step returns its
    instruction timings (``StepResult.timings``) to the sinks. ``memory_every``: steps 1, 2
    and every that many account memory (``StepResult.memory``); the metrics of the others
    carry the latest accounted peaks (every step of one program peaks alike once the
    optimizer state exists, which step 2 shows), since accounting costs time on every
    instruction.

    One step is kept in flight ahead (``Trainer.submit``): the next batch is drawn and sent
    while the workers compute this one, so the driver's round trip is off the step's
    critical path; steps run in order on the workers, so the run is the same as stepping
    one at a time. Nothing is sent ahead of a step after which the loop needs the workers
    quiet (an evaluation); ``step_seconds`` is the time from when the workers could start
    the step (its submission, or the previous step's end) to its result."""
    if steps is None and epochs is None:
        raise ValueError("fit needs steps or epochs")
    if eval_every and held_out is None:
        raise ValueError("evaluation every few steps needs held-out batches")
    if memory_every < 1:
        raise ValueError(f"memory_every must be >= 1, got {memory_every}")
    state = trainer.state
    state.data = data if hasattr(data, "state_dict") else None  # type: ignore[assignment]
    total = steps if steps is not None else _epoch_steps(data, epochs)
    history: list[StepMetrics] = []
    evals: list[EvalMetrics] = []
    paces: list[float] = []
    peaks: tuple[int, ...] = ()
    ahead: _Flight | None = None  # the submitted step whose result is not in yet
    last_done = time.perf_counter()
    ended = False

    def quiet_after(step: int) -> bool:
        """Whether the workers must be idle after ``step`` (no step sent ahead of it)."""
        return bool(eval_every) and step % eval_every == 0 and held_out is not None

    while True:
        flight = None
        if not ended and (steps is None or state.step < steps) and not (ahead and quiet_after(ahead.step)):
            t0 = time.perf_counter()
            try:
                inputs, targets = next(data)
                epoch = _epoch(data)
                ended = epochs is not None and epoch >= epochs
            except StopIteration:
                ended = True
            if not ended:
                t1 = time.perf_counter()
                tokens_before = state.tokens
                number = state.step + 1
                accounted = number <= 2 or number % memory_every == 0
                pending = trainer.submit(inputs, targets, profile=number == profile_step, memory=accounted)
                flight = _Flight(number, pending, epoch, t1 - t0, t1, state.tokens - tokens_before)
        if ahead is None:
            if flight is None:
                break
            ahead = flight
            continue
        result = ahead.pending.result()
        t2 = time.perf_counter()
        seconds = t2 - max(ahead.submitted, last_done)
        last_done = t2
        paces.append(seconds + ahead.data_seconds)
        # The first step includes warm-up (threads, communicators): leave it out of the pace.
        pace = sum(paces[1:]) / len(paces[1:]) if len(paces) > 1 else paces[0]
        if result.memory:
            peaks = tuple(m.total for m in result.memory)
        metrics = StepMetrics(
            step=ahead.step,
            epoch=ahead.epoch,
            loss=result.loss,
            lr=result.lr,
            grad_norm=result.grad_norm,
            step_seconds=seconds,
            data_seconds=ahead.data_seconds,
            samples_per_s=trainer.batch_size / seconds,
            tokens_per_s=ahead.tokens / seconds if ahead.tokens else None,
            peak_memory_bytes=peaks,
            eta_seconds=pace * (total - ahead.step) if total is not None else None,
            total_steps=total,
        )
        history.append(metrics)
        for sink in sinks:
            sink.on_step(metrics, result)
        if quiet_after(ahead.step) and held_out is not None:
            ev = evaluate(trainer, held_out, eval_batches)
            evals.append(ev)
            for sink in sinks:
                sink.on_eval(ev)
            last_done = time.perf_counter()
        ahead = flight
        if ahead is None and (ended or (steps is not None and state.step >= steps)):
            break
    return FitResult(tuple(history), tuple(evals))


@attrs.frozen
class _Flight:
    """A step sent to the workers: its number, handle, epoch, batch wait, when it was sent
    and its tokens."""

    step: int
    pending: PendingStep
    epoch: int
    data_seconds: float
    submitted: float
    tokens: int


def _epoch(data: object) -> int:
    state = getattr(data, "state_dict", None)
    return int(state().get("epoch", 0)) if callable(state) else 0


def _epoch_steps(data: object, epochs: int | None) -> int | None:
    """Steps in ``epochs`` epochs, when the data knows its epoch length."""
    stream = getattr(data, "stream", data)
    per_epoch = getattr(stream, "batches_per_epoch", None)
    return epochs * per_epoch if epochs is not None and per_epoch else None
