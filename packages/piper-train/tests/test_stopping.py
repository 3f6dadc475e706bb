"""``piper_train.stopping`` without processes: what a SIGTERM does inside and outside a
training loop that can stop, and a Ctrl-C whose exception was lost raised again."""

from __future__ import annotations

import os
import signal
import sys
import types

import pytest

from piper_train import stopping
from piper_train.stopping import EXIT_TERMINATED, StopRequest, Terminated, stopping_on_sigterm


@pytest.fixture
def handler():
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with stopping.handling_signals():
        yield
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == previous  # given back


def test_a_ctrl_c_whose_exception_was_lost_is_raised_again(handler, capsys) -> None:
    """As when it lands in an at-fork hook while ``ray.init`` starts its daemons: printed as
    "Exception ignored", dropped. ``raise_if_interrupted`` (the trainer's, once its workers are
    up and before each step) raises it again; outside the command's block, nothing."""
    stopping.raise_if_interrupted()  # nothing came yet
    try:
        os.kill(os.getpid(), signal.SIGINT)
    except KeyboardInterrupt as err:  # lost, and reported as Python reports such a loss: not printed
        sys.unraisablehook(types.SimpleNamespace(exc_type=KeyboardInterrupt, exc_value=err, exc_traceback=None,
                                                 err_msg="Exception ignored in", object=None))
    assert not capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt) as raised:
        stopping.raise_if_interrupted()
    assert not isinstance(raised.value, Terminated)
    with pytest.raises(Terminated):  # a SIGTERM that ended the command at once, lost the same way
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except Terminated:
            pass
        stopping.raise_if_interrupted()


def test_an_interrupt_is_forgotten_after_the_command_and_an_ignored_sigint_stays_ignored() -> None:
    hook = sys.unraisablehook
    with stopping.handling_signals():
        assert sys.unraisablehook is not hook
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    stopping.raise_if_interrupted()  # the next command (or a test in this process) is not interrupted
    assert sys.unraisablehook is hook  # given back
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a shell's background job
    try:
        with stopping.handling_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            stopping.raise_if_interrupted()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_a_loop_a_sigterm_ends_the_command_at_once(handler) -> None:
    assert not stopping.terminating()
    with pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
    # Ray raises a plain KeyboardInterrupt in its place inside ray.get: the flag tells them apart.
    assert issubclass(Terminated, KeyboardInterrupt) and stopping.terminating() and EXIT_TERMINATED == 143
    with stopping.handling_signals():
        assert not stopping.terminating()


def test_in_a_loop_the_first_sigterm_asks_to_stop_and_the_second_ends_at_once(handler, capsys) -> None:
    request = StopRequest()
    with stopping_on_sigterm(request):
        assert not request
        os.kill(os.getpid(), signal.SIGTERM)
        assert request and request.reason == "SIGTERM"
        assert "a second SIGTERM ends the run at once" in capsys.readouterr().err
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Terminated):  # the block is over: at once again
        os.kill(os.getpid(), signal.SIGTERM)


def test_the_first_reason_is_kept() -> None:
    request = StopRequest()
    request.request("SIGTERM")
    request.request("later")
    assert request.reason == "SIGTERM"
