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
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

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


def terminating() -> bool:
    """Whether a SIGTERM asked this process to end at once: a ``KeyboardInterrupt`` caught
    after it is that request (Ray raises its own in place of ``Terminated``)."""
    return _terminating


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    """The ``piper`` command's SIGTERM handler (module doc)."""
    global _terminating
    request = _active
    if request is None or request:
        _terminating = True
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
def handling_sigterm() -> Iterator[None]:
    """``on_sigterm`` is the process's SIGTERM handler within the block, no termination asked
    for yet; the handler before comes back after it. The main thread only, as Python's
    signals require (elsewhere nothing changes)."""
    global _terminating
    _terminating = False
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def stopping_on_sigterm(request: StopRequest) -> Iterator[StopRequest]:
    """Within the block, a first SIGTERM asks ``request`` to stop (``on_sigterm``)."""
    global _active
    previous, _active = _active, request
    try:
        yield request
    finally:
        _active = previous
