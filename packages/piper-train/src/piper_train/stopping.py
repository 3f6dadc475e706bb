"""Ending a run early on request, at a step's boundary, with its state saved.

A cluster scheduler (SLURM, Kubernetes, a spot instance going away) ends a job with SIGTERM
and, a grace period later, SIGKILL. Dying at the signal loses every step since the last
checkpoint; ``fit`` instead stops when asked (``StopRequest``): it sends no further step,
lets the steps already sent finish, writes a checkpoint of the last one (with a
``Checkpoints``) and returns, its ``FitResult.stopped`` saying why.

``on_sigterm`` is the ``piper`` command's handler: while a ``stopping_on_sigterm(request)``
block runs (``piper train``'s loop), the first SIGTERM asks ``request`` to stop and a second
one ends the run at once; elsewhere (starting workers, ``piper check``, ``piper tune``) a
SIGTERM ends the command at once. Ending at once raises ``Terminated``, a
``KeyboardInterrupt``, so it unwinds as Ctrl-C does (workers are shut down, the checkpoints
already written stay complete: each is written to a temporary folder and renamed) and passes
through Ray: a signal handler's exception raised inside ``ray.get``/``ray.wait`` reaches the
caller only as a ``KeyboardInterrupt`` (any other becomes a ``SystemError``), so Ray raises
a plain one there; ``terminating()`` tells the command it came from SIGTERM (exit 143).

A signal handler's exception can also be lost: raised while the interpreter runs a hook it
cannot propagate from (``ray.init`` forking its daemons runs ``logging``'s at-fork hooks), it
is printed as "Exception ignored in ..." and dropped, and the command went on as if no Ctrl-C
had come (measured: 2 of 18 presses during worker start-up; the run then trained to its end).
So the ``piper`` command's handlers (``handling_signals``) also note an interrupt (and keep
its dropped exception's traceback off stderr), and ``raise_if_interrupted`` raises it again
where the trainer can: once its workers are up, and before each step's call.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: the shell's code for a process ended by SIGTERM


class Terminated(KeyboardInterrupt):
    """The process was asked to end now (SIGTERM); unwinds as Ctrl-C does (module doc)."""


class StopRequest:
    """A request to end training at the next step boundary, set from any thread or a signal
    handler (``request``) and read by ``fit`` between steps."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None

    def request(self, reason: str) -> None:
        """Ask to stop; ``reason`` (e.g. ``"SIGTERM"``) ends up in ``FitResult.stopped``. The
        first reason given is kept."""
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()


_active: StopRequest | None = None  # what the next SIGTERM asks to stop, if anything
_terminating = False  # a SIGTERM asked to end the process at once
_interrupted = False  # a Ctrl-C or such a SIGTERM came (its exception may have been lost)


def terminating() -> bool:
    """Whether a SIGTERM asked this process to end at once: a ``KeyboardInterrupt`` caught
    after it is that request (Ray raises its own in place of ``Terminated``)."""
    return _terminating


def raise_if_interrupted() -> None:
    """Raise again the interrupt (Ctrl-C, or a SIGTERM ending the command at once) that the
    ``piper`` command's handlers took, in case its exception was lost (module doc). Nothing
    outside ``handling_signals``, nor before any such signal."""
    if _interrupted:
        raise Terminated() if _terminating else KeyboardInterrupt()


def on_sigint(signum: int, frame: FrameType | None) -> None:
    """The ``piper`` command's SIGINT handler: Python's own (``KeyboardInterrupt``), noted."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt()


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    """The ``piper`` command's SIGTERM handler (module doc)."""
    global _terminating, _interrupted
    request = _active
    if request is None or request:
        _terminating = _interrupted = True
        raise Terminated()
    request.request("SIGTERM")
    _say("piper: SIGTERM: stopping after the steps already sent (a checkpoint is written with --checkpoint-dir); "
         "a second SIGTERM ends the run at once\n")


def _say(text: str) -> None:
    """To stderr's file descriptor where it has one: a signal handler that prints through
    ``sys.stderr`` while the interrupted code is inside that stream's write fails ("reentrant
    call"). A stream without one (captured output) is written as a stream."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        sys.stderr.write(text)
    else:
        os.write(fd, text.encode())


@contextlib.contextmanager
def handling_signals() -> Iterator[None]:
    """Within the block ``on_sigterm`` handles SIGTERM, and ``on_sigint`` SIGINT where Python's
    own handler has it (not where it is ignored, as in a shell's background job); no
    interrupt or termination asked for yet. The handlers before come back after it. The main
    thread only, as Python's signals require (elsewhere nothing changes)."""
    global _terminating, _interrupted
    _terminating = _interrupted = False
    if threading.current_thread() is not threading.main_thread():
        yield
        _interrupted = False
        return
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_sigint)
    previous_hook = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        # An interrupt dropped where it cannot propagate: raised again later, not a traceback now.
        if not (_interrupted and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            previous_hook(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        _interrupted = False  # the command is over: nothing to raise again in whatever runs next
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if previous_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, previous_int)


@contextlib.contextmanager
def stopping_on_sigterm(request: StopRequest) -> Iterator[StopRequest]:
    """Within the block, a first SIGTERM asks ``request`` to stop (``on_sigterm``)."""
    global _active
    previous, _active = _active, request
    try:
        yield request
    finally:
        _active = previous
