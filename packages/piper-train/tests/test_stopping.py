"""``piper_train.stopping`` without processes: what a SIGTERM does inside and outside a
training loop that can stop."""

from __future__ import annotations

import os
import signal

import pytest

from piper_train import stopping
from piper_train.stopping import EXIT_TERMINATED, StopRequest, Terminated, stopping_on_sigterm


@pytest.fixture
def handler():
    previous = signal.getsignal(signal.SIGTERM)
    with stopping.handling_sigterm():
        yield
    assert signal.getsignal(signal.SIGTERM) is previous  # given back


def test_outside_a_loop_a_sigterm_ends_the_command_at_once(handler) -> None:
    assert not stopping.terminating()
    with pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
    # Ray raises a plain KeyboardInterrupt in its place inside ray.get: the flag tells them apart.
    assert issubclass(Terminated, KeyboardInterrupt) and stopping.terminating() and EXIT_TERMINATED == 143
    with stopping.handling_sigterm():
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
