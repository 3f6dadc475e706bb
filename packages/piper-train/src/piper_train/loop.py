"""``fit``: the training loop, a new batch per step, held-out evaluation, metrics to sinks.

The loop draws each step's batch from an iterator of ``(inputs, targets)`` (a
``BatchStream``, or a ``Prefetcher`` over one so the next batch loads while the workers run
this step), runs each step at the schedule's learning rate, and hands ``StepMetrics``
(loss, learning rate, gradient norm, step time, samples/s, tokens/s, peak memory per rank,
ETA) to each sink; the next call (of one or more steps, ``Trainer.submit_steps``: as many
as ``steps_per_call`` says, ``piper_train.call_size``) is sent while this one computes. It
stops after ``steps`` steps of the trainer's ``TrainState`` (so a trainer restored from a
checkpoint continues to the same end), after ``epochs`` epochs (without drawing a batch
past them when the data knows its length), or when the data ends. With ``eval_every`` it
evaluates ``held_out`` after every that many steps. The batch stream is the
``TrainState``'s ``data`` while it runs.

Checkpoints (``Checkpoints``): every ``every`` steps and at the end, into ``root``, keeping
the newest ``keep``; ``resume`` continues from the latest complete one. A root that already
holds checkpoints is refused without ``resume`` (nothing of another run is overwritten or
pruned). With ``Checkpoints(asynchronous=True)`` the ranks write each periodic checkpoint
while the next steps run (the steps wait only for their copy of what they hold), and the
loop completes it between steps once they are done; a failure meanwhile takes that one
checkpoint with it. Every checkpoint is said to the sinks that have ``on_checkpoint``.
Fault tolerance: ``max_restarts`` times, an ``ExecutionError`` that may pass (a worker died,
raised, or did not answer within the step timeout; the runtime has torn every worker down)
makes ``fit`` start new workers (``Trainer.restart``), reload the latest complete checkpoint
(or, without one, go back to the state ``fit`` began with, when that was the start of
training) and go on; the steps after that checkpoint are recomputed (``FitResult.restarts``
says how many) and drop out of ``FitResult.steps``. It does not restart for a failure that
would come back (``_why_final``): one that is not ``transient`` (a NaN, ``NumericalError``; a
checkpoint the disk refuses for want of space or permission, ``StorageError``), or one that
came back the same way at the same step after a restart (an exception of the model's code).
The error it raises then says so and why.

Stopping early (``stop``, a ``piper_train.stopping.StopRequest``; ``piper train`` sets one on
SIGTERM): no further step is sent, the steps already sent finish, the last one is
checkpointed (with ``checkpoints``), and ``FitResult.stopped`` says why.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import attrs
import torch
from torch.utils.data import DataLoader, Dataset

from piper_ir import CheckpointError, ExecutionError, NumericalError, StorageError
from piper_runtime import PendingStep, StepResult
from piper_train import stopping
from piper_train.batches import Batch, BatchStream, batch_size
from piper_train.call_size import AUTO, CallSize
from piper_train.checkpoints import Checkpoints, PendingCheckpoint, prune
from piper_train.flops import Throughput
from piper_train.hardware import Hardware
from piper_train.metrics import CheckpointMetrics, EvalMetrics, Sink, StepMetrics
from piper_train.stopping import StopRequest
from piper_train.trainer import Trainer, batch_tokens

MEMORY_EVERY = 100  # fit accounts memory on steps 1, 2 and every this many


@attrs.frozen
class Restart:
    """One recovery from a failed step: the step that failed, the step of the checkpoint
    reloaded (0: the start), how many finished steps were lost and recomputed, and how long
    new workers took to start and load it."""

    failed_step: int
    resumed_from: int
    recomputed: int
    seconds: float
    error: str


@attrs.frozen
class FitResult:
    steps: tuple[StepMetrics, ...]
    evals: tuple[EvalMetrics, ...]
    restarts: tuple[Restart, ...] = ()
    checkpoints: tuple[Path, ...] = ()  # written by this run, oldest first
    calls: tuple[int, ...] = ()  # the steps of each call sent to the workers, in order
    stopped: str | None = None  # why the run ended before its end (``StopRequest.reason``)
    stop_failure: str | None = None  # what ended the workers after the stop was asked for, if anything


def evaluate(trainer: Trainer, held_out: Callable[[int], Batch], batches: int) -> EvalMetrics:
    """The mean loss of held-out batches ``0 .. batches-1`` (forward only)."""
    if batches < 1:
        raise ValueError(f"evaluation needs at least one batch, got {batches}")
    started = time.perf_counter()
    losses = [trainer.evaluate(*held_out(k)) for k in range(batches)]
    return EvalMetrics(trainer.state.step, sum(losses) / len(losses), batches, time.perf_counter() - started)


def fit(
    trainer: Trainer,
    data: Iterator[Batch] | Iterable[Batch] | DataLoader,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    held_out: Callable[[int], Batch] | None = None,
    eval_every: int = 0,
    eval_batches: int = 1,
    sinks: Sequence[Sink] = (),
    profile_step: int | None = None,
    checkpoints: Checkpoints | None = None,
    resume: bool = False,
    max_restarts: int = 0,
    memory_every: int = MEMORY_EVERY,
    steps_per_call: int | str = AUTO,
    stop: StopRequest | None = None,
    hardware: Hardware | None = None,
) -> FitResult:
    """Train until ``steps`` steps (counted by ``trainer.state.step``) or ``epochs`` epochs
    are done, or ``data`` ends (module doc). ``data`` is an iterator of ``(inputs, targets)``
    batches (a ``BatchStream``), or what ``BatchStream`` reads (a list of batches, re-read
    each epoch; a ``DataLoader``, its shuffling seeded per epoch from the trainer's seed), which
    ``fit`` wraps in one. It reports its position through ``state_dict()`` (``epoch``) where it
    has one. ``profile_step``: that step returns its
    instruction timings (``StepResult.timings``) to the sinks. ``checkpoints``, ``resume``,
    ``max_restarts``: module doc. ``memory_every``: steps 1, 2 and every that many account
    memory (``StepResult.memory``); the metrics of the others carry the latest accounted
    peaks (every step of one program peaks alike once the optimizer state exists, which
    step 2 shows), since accounting costs time on every instruction.

    One step is kept in flight ahead (``Trainer.submit``): the next batch is drawn and sent
    while the workers compute this one, so the driver's round trip is off the step's
    critical path; steps run in order on the workers, so the run is the same as stepping
    one at a time. Nothing is sent ahead of a step after which the loop needs the workers
    quiet (an evaluation or a checkpoint); ``step_seconds`` is the time from when the
    workers could start the step (its submission, or the previous step's end) to its
    result. A step sent ahead of one that fails is dropped with it (the restart goes back
    to a checkpoint or the start either way).

    ``hardware``: the devices' description (piper_train.hardware), for each step's MFU; each
    step's model TFLOP/s per device is reported either way when the example batch's FLOPs can
    be counted on the meta device (piper_train.flops).

    ``steps_per_call``: send up to that many consecutive steps in one call per rank
    (``Trainer.submit_steps``; tf.keras calls it ``steps_per_execution``), one call kept in
    flight ahead, each call ending at the latest on a step after which the workers must be
    quiet. Each step computes what it would alone; what is saved is a call's overhead per
    step: Ray's hand-over on each rank and the driver's work of sending the call, which on a
    host whose cores the ranks fill comes out of the step (``piper_train.call_size``). The
    results of a call arrive together, so the sinks see them in bursts and
    ``step_seconds`` is the call's time divided by its steps. ``"auto"`` (the default) sends
    single steps while it measures the pace, then as many as fit in about half a second (at
    most 16 steps and 64 MiB of batches; one for a step that takes that long). A number
    above 1 is refused with ``on_nan="skip-step"``, which ``"auto"`` runs one step per
    call.

    ``stop``: once it is set, no further step is sent; the steps already sent finish (at most
    one call beyond the one computing, each bounded by the step timeout), the last is
    checkpointed with ``checkpoints``, and the result's ``stopped`` is the request's reason."""
    return TrainingRun(
        trainer, data, steps=steps, epochs=epochs, held_out=held_out, eval_every=eval_every,
        eval_batches=eval_batches, sinks=sinks, profile_step=profile_step, checkpoints=checkpoints, resume=resume,
        max_restarts=max_restarts, memory_every=memory_every, steps_per_call=steps_per_call, stop=stop,
        hardware=hardware,
    ).run()


class TrainingRun:
    """One ``fit`` call: its options, where it stands and what it has produced so far, with
    one method per part of the loop (sending calls, taking in a step's result, evaluating and
    checkpointing, recovering from a failure) instead of closures sharing ``nonlocal`` state.
    Building one checks the options and prepares the trainer (attaches the data, resumes from
    a checkpoint); ``run`` trains (``fit`` documents the behaviour)."""

    def __init__(
        self,
        trainer: Trainer,
        data: Iterator[Batch] | Iterable[Batch] | DataLoader,
        *,
        steps: int | None,
        epochs: int | None,
        held_out: Callable[[int], Batch] | None,
        eval_every: int,
        eval_batches: int,
        sinks: Sequence[Sink],
        profile_step: int | None,
        checkpoints: Checkpoints | None,
        resume: bool,
        max_restarts: int,
        memory_every: int,
        steps_per_call: int | str,
        stop: StopRequest | None,
        hardware: Hardware | None = None,
    ) -> None:
        if steps is None and epochs is None:
            raise ValueError("fit needs steps or epochs")
        if eval_every and held_out is None:
            raise ValueError("evaluation every few steps needs held-out batches")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if memory_every < 1:
            raise ValueError(f"memory_every must be >= 1, got {memory_every}")
        # Model FLOPs of the example batch, for TFLOP/s and MFU (``--hardware``), counted on a
        # thread of its own once the first step is done: the first count in a process takes a
        # second or two of CPU (torch's FLOP counter imports torch._dynamo), which the first
        # steps need not wait for, nor share the CPUs with; they report no rate until then
        # (``_backfill_rates`` gives them theirs at the end).
        self._count_flops = functools.partial(trainer.throughput, hardware)
        self.throughput: concurrent.futures.Future | None = None
        self.rate_inputs: list[tuple[int, float]] = []  # each step's size and seconds, for its rates
        self.call_size = _call_size(steps_per_call, undoable=trainer.runtime.on_nan == "skip-step")
        self.trainer = trainer
        self.steps, self.epochs = steps, epochs
        self.held_out, self.eval_every, self.eval_batches = held_out, eval_every, eval_batches
        self.sinks, self.profile_step, self.memory_every = sinks, profile_step, memory_every
        self.checkpoints, self.max_restarts, self.stop = checkpoints, max_restarts, stop
        self.data = _batch_iterator(data, trainer.seed)
        self.state = state = trainer.state
        state.data = self.data if hasattr(self.data, "state_dict") else None  # type: ignore[assignment]
        self._open_checkpoints(resume)
        # Where a restart goes back to when no checkpoint is written yet: only the very start.
        self.start = state.state_dict() if state.step == 0 and state.data is not None else None
        self.in_epochs = _epoch_steps(self.data, epochs)  # the last step of the epochs, when the data knows its length
        self.total = steps if steps is not None else self.in_epochs
        self.history: list[StepMetrics] = []
        self.evals: list[EvalMetrics] = []
        self.paces: list[float] = []
        self.sizes: list[int] = []  # of the calls sent
        self.restarts: list[Restart] = []
        self.written: list[Path] = []
        self.saved_at = state.step if resume else -1
        self.peaks: tuple[int, ...] = ()
        self.inflight: collections.deque[_Flight] = collections.deque()  # sent, results not in yet; oldest first
        self.ended = False  # the data or the epochs ended
        self.abandoned: str | None = None  # how the workers failed after a stop was asked for: nothing more is saved
        self.writing: PendingCheckpoint | None = None  # a checkpoint the ranks are writing (asynchronous)
        self.last_failure: tuple[int, str] | None = None  # the step and the words of the failure restarted for last
        self.last_done = time.perf_counter()

    def _open_checkpoints(self, resume: bool) -> None:
        """Resume from the latest checkpoint, or refuse a root that holds another run's."""
        checkpoints = self.checkpoints
        if checkpoints is None:
            if resume:
                raise ValueError("resume needs a checkpoint directory")
            return
        latest = checkpoints.latest()
        if resume:
            self.trainer.load_checkpoint(checkpoints.root)
        elif latest is not None:
            raise CheckpointError(
                f"{checkpoints.root} already holds checkpoints (the latest: {latest.name}); resume from them, "
                "or choose another checkpoint directory (no checkpoint of another run is overwritten)"
            )

    def run(self) -> FitResult:
        """Train to the end (``fit``) and say what happened."""
        while True:
            stopping.raise_if_interrupted()  # a Ctrl-C whose exception was lost (``piper_train.stopping``)
            if self._collect_writing() or self._send_ahead():
                continue
            if not self.inflight:
                if self._wind_up():
                    break
                continue
            self._take(self.inflight.popleft())
        return self._result()

    def _collect_writing(self) -> bool:
        """Complete an asynchronous checkpoint the ranks have finished writing; whether it
        failed (then the run has recovered and the loop starts over)."""
        if self.writing is None or not self.writing.done():
            return False
        try:
            self._complete_writing()
        except ExecutionError as err:
            self._recover(err)
            self.inflight.clear()
            return True
        return False

    def _complete_writing(self) -> None:
        """Wait for the checkpoint being written and complete it (``ExecutionError`` when it
        fails: the checkpoints before it stay as they were)."""
        pending, self.writing = self.writing, None
        if pending is not None:
            assert self.checkpoints is not None  # only they start one
            self.written.append(_complete(pending, self.checkpoints, self.sinks))

    def _send_ahead(self) -> bool:
        """Keep one call in flight ahead of the one whose results come in next, unless the
        newest step sent must be followed by quiet workers; whether a call went."""
        inflight = self.inflight
        calls = {id(f.call) for f in inflight}
        if (len(calls) >= 2 or (inflight and self._quiet_after(inflight[-1].step))
                or (self.steps is not None and self.state.step >= self.steps) or self.stop):
            return False
        sent = self._send()
        inflight.extend(sent)
        return bool(sent)

    def _quiet_after(self, step: int) -> bool:
        """Whether the workers must be idle after ``step`` (no step sent ahead of it)."""
        evaluating = bool(self.eval_every) and step % self.eval_every == 0 and self.held_out is not None
        checkpoints = self.checkpoints
        saving = checkpoints is not None and bool(checkpoints.every) and step % checkpoints.every == 0
        return evaluating or saving

    def _send(self) -> list[_Flight]:
        """Draw the next call's batches and send them in one call; their flights."""
        drawn = self._draw()
        if not drawn:
            return []
        first = self.state.step + 1
        numbers = range(first, first + len(drawn))
        if self.profile_step in numbers:
            # The profiled step runs with no FLOP count beside it: the profiler records every
            # thread of the process, so on the local runtime the count's operators would land
            # in the step's trace, and anywhere the count would take CPU from the step.
            self._throughput(wait=FLOPS_WAIT_S)
        pendings = self.trainer.submit_steps(
            [batch for batch, _, _ in drawn],
            profile=[n == self.profile_step for n in numbers],
            memory=[n <= 2 or n % self.memory_every == 0 for n in numbers],
        )
        call = _Call(time.perf_counter(), len(drawn))
        self.sizes.append(len(drawn))
        # The programs the trainer holds once this call's batches are sent (one per shape of a
        # batch's pieces), and the seconds it spent compiling the ones beyond the first.
        plans, compiled = getattr(self.trainer, "plans", 1), sum(getattr(self.trainer, "variant_seconds", ()))
        return [
            _Flight(n, pending, epoch, waited, call, batch_tokens(tuple(batch[0])), batch_size(batch), plans, compiled)
            for n, pending, (batch, epoch, waited) in zip(numbers, pendings, drawn, strict=True)
        ]

    def _draw(self) -> list[tuple[Batch, int, float]]:
        """Up to ``call_size.next()`` batches, as far as the next step after which the workers
        must be quiet: each with its epoch and the seconds waited for it. Sets ``ended`` when
        the data or the epochs end."""
        drawn: list[tuple[Batch, int, float]] = []
        limit = self.call_size.next()
        agree = getattr(self.trainer.runtime, "agree", None)
        if self.call_size.auto and agree is not None:  # by the clock: under torchrun rank 0's size holds in all
            limit = agree(limit)
        nbytes = 0
        while not self.ended and len(drawn) < limit:
            number = self.state.step + 1 + len(drawn)
            if (self.steps is not None and number > self.steps) or (self.in_epochs is not None
                                                                     and number > self.in_epochs):
                # Not even drawn: the data's position stays at the end of the last epoch, so a
                # run resumed with more epochs starts the next one at its first batch.
                self.ended = self.ended or (self.in_epochs is not None and number > self.in_epochs)
                break
            t0 = time.perf_counter()
            try:
                batch = next(self.data)
                epoch = _epoch(self.data)
                self.ended = self.epochs is not None and epoch >= self.epochs
            except StopIteration:
                self.ended = True
            if self.ended:
                break
            drawn.append((batch, epoch, time.perf_counter() - t0))
            nbytes += _batch_bytes(batch)
            if self._quiet_after(number) or self.call_size.full(nbytes):
                break
        return drawn

    def _wind_up(self) -> bool:
        """Nothing in flight and nothing more to send (the step count reached, the data or the
        epochs ended, a stop asked for): write the last checkpoint, which a failure while
        writing it sends back to the one before; whether the run is over."""
        checkpoints = self.checkpoints
        try:
            self._complete_writing()
            if (checkpoints is None or self.saved_at == self.state.step or self.state.step == 0
                    or self.abandoned is not None):
                return True
            self.written.append(_save(self.trainer, checkpoints, self.sinks))
            self.saved_at = self.state.step
        except ExecutionError as err:
            self._recover(err)
        return False

    def _take(self, flight: _Flight) -> None:
        """The oldest step's result: its metrics to the sinks, then what follows that step
        (an evaluation, a checkpoint). A failure restarts (``_recover``) and drops the steps
        sent after it."""
        try:
            result = flight.pending.result()
        except ExecutionError as err:
            # In a call of several steps the error names the one that failed.
            self._recover(err, err.step if err.step is not None and err.step > flight.step else flight.step)
            self.inflight.clear()  # the steps sent after the one that failed go with it
            self.last_done = time.perf_counter()
            return
        metrics = self._metrics(flight, result)
        self.history.append(metrics)
        for sink in self.sinks:
            sink.on_step(metrics, result)
        try:
            self._evaluate_and_save(flight.step)
        except ExecutionError as err:
            self._recover(err)
            self.inflight.clear()
        if self._quiet_after(flight.step):
            self.last_done = time.perf_counter()

    def _metrics(self, flight: _Flight, result: StepResult) -> StepMetrics:
        """``StepMetrics`` of a step: its call's time per step, the pace so far (for the ETA)
        and the latest accounted memory peaks."""
        seconds = self._seconds_per_step(flight.call)
        paces = self.paces
        paces.append(seconds + flight.data_seconds)
        # The first step includes warm-up (threads, communicators): leave it out of the pace.
        pace = sum(paces[1:]) / len(paces[1:]) if len(paces) > 1 else paces[0]
        if result.memory:
            self.peaks = tuple(m.total for m in result.memory)
        total = self.total
        return StepMetrics(
            step=flight.step,
            epoch=flight.epoch,
            loss=result.loss,
            lr=result.lr,
            grad_norm=result.grad_norm,
            step_seconds=seconds,
            data_seconds=flight.data_seconds,
            samples_per_s=flight.samples / seconds,
            tokens_per_s=flight.tokens / seconds if flight.tokens else None,
            **self._flop_rates(flight, seconds),
            peak_memory_bytes=self.peaks,
            eta_seconds=pace * (total - flight.step) if total is not None else None,
            total_steps=total,
            nonfinite=result.nonfinite,
            skipped=result.skipped,
            plans=flight.plans,
            plan_seconds=flight.plan_seconds,
            torch_compile_seconds=max(getattr(result, "compile_seconds", ()), default=0.0),  # a runtime may not say
        )

    def _flop_rates(self, flight: _Flight, seconds: float) -> dict[str, float | None]:
        """The step's TFLOP/s per device and MFU (piper_train.flops), when its FLOPs are known.
        The last step's record waits for the count, as the run's end does anyway
        (``_backfill_rates``): a run shorter than the count still prints a rate."""
        self.rate_inputs.append((flight.tokens or flight.samples, seconds))
        last = self.total is not None and flight.step >= self.total
        rate = self._throughput(wait=FLOPS_WAIT_S if last else 0)
        if rate is None:
            return {}
        tflops, mfu = rate.step(flight.tokens or flight.samples, seconds)
        return {"tflops_per_device": tflops, "mfu": mfu}

    def _throughput(self, wait: float) -> Throughput | None:
        if self.throughput is None:
            self.throughput = _background(self._count_flops)
        try:
            return self.throughput.result(timeout=wait)
        except Exception:
            return None

    def _backfill_rates(self) -> None:
        """Give the steps that ended before the FLOPs were counted their rates (in the
        history, hence ``--json``; the sinks had their records already), waiting a bounded
        time for the count."""
        if len(self.rate_inputs) != len(self.history) or all(m.tflops_per_device is not None for m in self.history):
            return
        rate = self._throughput(wait=FLOPS_WAIT_S)
        if rate is None:
            return
        for i, (m, (size, seconds)) in enumerate(zip(self.history, self.rate_inputs, strict=True)):
            if m.tflops_per_device is None:
                tflops, mfu = rate.step(size, seconds)
                self.history[i] = attrs.evolve(m, tflops_per_device=tflops, mfu=mfu)

    def _seconds_per_step(self, call: _Call) -> float:
        """A call's time per step, measured at its first result (all of its results are in
        then): from when the workers could start it (its submission, or the previous call's
        end) to now, over its steps; the call size learns from it."""
        if call.seconds_per_step is None:
            now = time.perf_counter()
            call.seconds_per_step = (now - max(call.submitted, self.last_done)) / call.steps
            self.last_done = now
            self.call_size.observe(call.seconds_per_step, call.steps)
        return call.seconds_per_step

    def _evaluate_and_save(self, step: int) -> None:
        """Evaluate the held-out batches and checkpoint after ``step``, where they are due."""
        if self.eval_every and step % self.eval_every == 0 and self.held_out is not None:
            ev = evaluate(self.trainer, self.held_out, self.eval_batches)
            self.evals.append(ev)
            for sink in self.sinks:
                sink.on_eval(ev)
        checkpoints = self.checkpoints
        if checkpoints is not None and checkpoints.every and step % checkpoints.every == 0:
            if checkpoints.asynchronous:
                self._complete_writing()  # one at a time
                self.writing = _begin(self.trainer, checkpoints)
            else:
                self.written.append(_save(self.trainer, checkpoints, self.sinks))
            self.saved_at = self.state.step

    def _recover(self, err: ExecutionError, failed: int | None = None) -> None:
        """After ``err``: restart and go back to the latest checkpoint (or the start), or raise
        ``err`` (saying why it is not restarted for). Only a failure that may pass restarts
        the workers (module doc, ``_why_final``). Once a stop is asked for, the run ends
        without starting new workers (the machine may be going away: a SIGTERM to every
        process of a job), with what is saved."""
        if self.writing is not None:  # its ranks are gone with the others: what they wrote is not a checkpoint
            self.writing.abandon()
            self.writing = None
        if self.stop and not isinstance(err, NumericalError):
            self.abandoned = self.abandoned or str(err).splitlines()[0]
            return
        failed = failed or self.state.step + 1
        if len(self.restarts) >= self.max_restarts:
            raise err
        failure = (failed, _signature(err))
        why = _why_final(err, failed, repeated=failure == self.last_failure)
        self.last_failure = failure
        if why is not None:
            raise _not_restarted(err, why) from err
        self._restart(err, failed)

    def _restart(self, err: ExecutionError, failed: int) -> None:
        """New workers, the latest checkpoint (or the start) reloaded, the lost steps' metrics
        dropped; raises ``err`` when there is nothing to go back to."""
        began = time.perf_counter()
        source = self.checkpoints.latest() if self.checkpoints is not None else None
        if source is None and self.start is None:
            raise err
        state = self.state
        self.trainer.restart()
        if source is not None:
            self.trainer.load_checkpoint(source)
            self.saved_at = state.step  # that checkpoint is this state: not written again at the end
        else:
            state.load_state_dict(self.start)
        self.ended = False  # the data is back where the state was
        self.restarts.append(Restart(failed, state.step, failed - 1 - state.step, time.perf_counter() - began,
                                     str(err).splitlines()[0]))
        kept = sum(1 for m in self.history if m.step <= state.step)
        del self.history[kept:], self.rate_inputs[kept:]
        del self.evals[sum(1 for e in self.evals if e.step <= state.step):]

    def _result(self) -> FitResult:
        self._backfill_rates()
        # A stop asked for once the run had nothing left to do changed nothing.
        finished = self.ended or any(last is not None and self.state.step >= last
                                     for last in (self.steps, self.in_epochs))
        stop = self.stop
        return FitResult(tuple(self.history), tuple(self.evals), tuple(self.restarts), tuple(self.written),
                         tuple(self.sizes), stop.reason if stop and not finished else None, self.abandoned)


def _call_size(steps_per_call: int | str, *, undoable: bool) -> CallSize:
    """The ``CallSize`` of ``steps_per_call``: one step per call where a step may be undone
    (``on_nan="skip-step"``, ``undoable``), which refuses a number above 1; ``ValueError`` for
    a size below 1."""
    if isinstance(steps_per_call, int) and steps_per_call > 1 and undoable:
        raise ValueError("steps_per_call > 1 cannot be combined with on_nan='skip-step' (a step is undone "
                         "before the next one runs)")
    return CallSize(steps_per_call, single=undoable)


@attrs.define
class _Call:
    """Steps sent to the workers in one call: when, how many, and (once its results are in)
    the time per step."""

    submitted: float
    steps: int
    seconds_per_step: float | None = None


@attrs.frozen
class _Flight:
    """A step sent to the workers: its number, handle, epoch, wait for its batch, the call
    it went in, its tokens and samples (batches may differ in size: an epoch's last)."""

    step: int
    pending: PendingStep
    epoch: int
    data_seconds: float
    call: _Call
    tokens: int
    samples: int
    plans: int = 1
    plan_seconds: float = 0.0


def _batch_iterator(data: object, seed: int) -> Iterator[Batch]:
    """``data`` itself where it is an iterator, else a ``BatchStream`` over it; a Dataset
    needs a batch size, which only the caller knows."""
    if hasattr(data, "__next__"):
        return data  # type: ignore[return-value]
    if isinstance(data, Dataset) and not isinstance(data, DataLoader):
        raise ValueError("fit: a Dataset is batched by a batch size fit does not know: pass "
                         "BatchStream(dataset, batch_size=N) or a DataLoader")
    return BatchStream(data, seed=seed, name="fit's data")


def _save(trainer: Trainer, checkpoints: Checkpoints, sinks: Sequence[Sink]) -> Path:
    """Write this step's checkpoint, tell the sinks that have ``on_checkpoint``, and prune old
    ones. A write the storage refuses for good (no space, no permission: on the driver or a
    rank) fails the run with a ``StorageError`` that says so first; the driver's other file
    errors (the folder gone) like a worker's would (``ExecutionError``), not with a traceback;
    the checkpoints before stay as they were (``_fail_writing``)."""
    target = checkpoints.path(trainer.state.step)
    started = time.perf_counter()
    try:
        path = trainer.save_checkpoint(target)
        seconds = time.perf_counter() - started
        written = CheckpointMetrics(trainer.state.step, str(path), _bytes_under(path), seconds, seconds)
        if getattr(trainer, "coordinator", True):  # under torchrun rank 0's process alone deletes
            prune(checkpoints.root, checkpoints.keep)
    except (OSError, ExecutionError) as err:
        _fail_writing(err, target)
    _tell(sinks, written)
    return path


def _begin(trainer: Trainer, checkpoints: Checkpoints) -> PendingCheckpoint:
    """Start this step's checkpoint; the ranks write it while the next steps run."""
    target = checkpoints.path(trainer.state.step)
    try:
        return trainer.begin_checkpoint(target)
    except (OSError, ExecutionError) as err:
        _fail_writing(err, target)


def _complete(pending: PendingCheckpoint, checkpoints: Checkpoints, sinks: Sequence[Sink]) -> Path:
    """Wait for a checkpoint being written, complete it, tell the sinks and prune (as ``_save``)."""
    try:
        path = pending.finish()
        written = CheckpointMetrics(int(pending.manifest["step"]), str(path), _bytes_under(path),
                                    time.perf_counter() - pending.started, pending.staged_seconds)
        if pending.coordinator:
            prune(checkpoints.root, checkpoints.keep)
    except (OSError, ExecutionError) as err:
        _fail_writing(err, pending.path)
    _tell(sinks, written)
    return path


def _fail_writing(err: OSError | ExecutionError, target: Path) -> NoReturn:
    """Raise what a failed checkpoint write is, the cause first: a ``StorageError`` ("no space
    left on device writing checkpoint <target>") where the disk refused it on the driver or on
    a rank, else an ``ExecutionError`` naming the checkpoint (the driver's other ``OSError``)
    or ``err`` itself (a rank that failed otherwise)."""
    cause = _os_error(err)
    ranks = err.ranks if isinstance(err, ExecutionError) else ()
    step = err.step if isinstance(err, ExecutionError) else None
    final = None if cause is None else StorageError.of(cause, f"writing checkpoint {target}", ranks=ranks, step=step)
    if final is not None:
        raise final from err
    if isinstance(err, ExecutionError):
        raise err
    raise ExecutionError(f"writing checkpoint {target} failed: {err.strerror or err}") from err


def _os_error(err: BaseException) -> OSError | None:
    """The ``OSError`` behind ``err``: itself, or one it was raised from or while handling,
    or a rank's (the ``cause`` of the Ray task error the runtime raised its error while
    handling; looked up by name so that this module needs no ray)."""
    seen: set[int] = set()
    at: BaseException | None = err
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        worker = getattr(at, "cause", None)  # ray.exceptions.RayTaskError: what the worker raised
        if isinstance(worker, OSError) and worker.errno is not None:
            return worker
        if isinstance(at, OSError) and at.errno is not None:
            return at
        at = at.__cause__ or at.__context__
    return None


def _signature(err: ExecutionError) -> str:
    """A failure's words without what differs between workers (their ids, the traceback's
    frames): its kind and the last line of its message, where a worker's exception is named."""
    lines = [line for line in err.message.splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1].strip() if lines else ''}"


def _why_final(err: ExecutionError, failed: int, *, repeated: bool) -> str | None:
    """Why restarting would not get past ``err`` (``None``: it may)."""
    if isinstance(err, NumericalError):
        return "the same data gives the same NaN or Inf (on_nan says what to do with one)"
    if isinstance(err, StorageError):
        return "a full disk, a refused permission or a read-only filesystem stays so when the steps run again"
    if not err.transient:
        return f"{type(err).__name__} does not pass by running the steps again"
    if repeated:
        return f"it failed the same way at step {failed} after a restart, so it comes back each time"
    return None


def _not_restarted(err: ExecutionError, why: str) -> ExecutionError:
    """``err`` with why ``fit`` did not restart for it, of the same kind."""
    return type(err)(f"{err.message.rstrip()}\n  not restarted: {why}", nodes=err.nodes, ranks=err.ranks, step=err.step)


def _tell(sinks: Sequence[Sink], written: CheckpointMetrics) -> None:
    for sink in sinks:
        on_checkpoint = getattr(sink, "on_checkpoint", None)
        if callable(on_checkpoint):
            on_checkpoint(written)


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _batch_bytes(batch: Batch) -> int:
    """What a batch's tensors (inputs and targets) weigh."""
    return sum(t.nbytes for part in batch for t in part if isinstance(t, torch.Tensor))


def _epoch(data: object) -> int:
    state = getattr(data, "state_dict", None)
    return int(state().get("epoch", 0)) if callable(state) else 0


def _epoch_steps(data: object, epochs: int | None) -> int | None:
    """Steps in ``epochs`` epochs, when the data knows its epoch length."""
    stream = getattr(data, "stream", data)
    per_epoch = getattr(stream, "batches_per_epoch", None)
    return epochs * per_epoch if epochs is not None and per_epoch else None


FLOPS_WAIT_S = 30.0  # the most a run's end waits for its FLOPs to be counted


def _background(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """``fn(*args)`` on a daemon thread; its future."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:
            future.set_exception(err)

    threading.Thread(target=run, name="piper-flops", daemon=True).start()
    return future
