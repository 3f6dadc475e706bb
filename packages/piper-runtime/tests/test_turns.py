"""``Turns``: numbered step calls run one at a time in number order, whatever order their
threads arrive in; a failure passes the turn on; a missing predecessor is an error in bound."""

from __future__ import annotations

import threading
import time

import pytest

from piper_ir import ExecutionError
from piper_runtime.turns import Turns


def _run_calls(turns: Turns, arrival: list[int], hold_s: float = 0.01) -> list[tuple[str, int]]:
    """Start one thread per call number in ``arrival`` order; each records entering and
    leaving its turn."""
    log: list[tuple[str, int]] = []
    lock = threading.Lock()

    def call(number: int) -> None:
        with turns.turn(number, timeout_s=10.0):
            with lock:
                log.append(("in", number))
            time.sleep(hold_s)
            with lock:
                log.append(("out", number))

    threads = []
    for number in arrival:
        t = threading.Thread(target=call, args=(number,))
        t.start()
        threads.append(t)
        time.sleep(0.005)  # arrive in the given order
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    return log


def test_calls_run_in_number_order_one_at_a_time() -> None:
    log = _run_calls(Turns(0), [3, 1, 4, 2])
    assert log == [(side, n) for n in (1, 2, 3, 4) for side in ("in", "out")]


def test_a_failed_call_passes_the_turn_on() -> None:
    turns = Turns(0)
    done: list[int] = []

    def second() -> None:
        with turns.turn(2, timeout_s=10.0):
            done.append(2)

    t = threading.Thread(target=second)
    t.start()
    with pytest.raises(RuntimeError, match="boom"), turns.turn(1, timeout_s=10.0):
        raise RuntimeError("boom")
    t.join(10)
    assert done == [2]


def test_a_predecessor_that_never_arrives_is_an_error_within_the_bound() -> None:
    turns = Turns(3)
    started = time.monotonic()
    with pytest.raises(ExecutionError, match=r"rank 3: step call 1 did not arrive within 0.2 s of call 2"):
        with turns.turn(2, timeout_s=0.2):
            pass
    assert time.monotonic() - started < 5
    with turns.turn(1, timeout_s=1.0):  # the turns are still usable: call 1 runs, then a new 2
        pass
    with turns.turn(2, timeout_s=1.0):
        pass


def test_a_predecessor_that_arrived_is_waited_for_past_the_bound() -> None:
    """The bound is on arriving: a predecessor that is running may take longer (its own
    waits are bounded, and the driver's watchdog watches the step)."""
    turns = Turns(0)
    order: list[int] = []

    def first() -> None:
        with turns.turn(1, timeout_s=0.1):
            time.sleep(0.5)
            order.append(1)

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.05)
    with turns.turn(2, timeout_s=0.1):
        order.append(2)
    t.join(10)
    assert order == [1, 2]


def test_a_number_used_twice_is_refused() -> None:
    turns = Turns(0)
    with turns.turn(1, timeout_s=1.0):
        pass
    with pytest.raises(ExecutionError, match="step call 1 arrived twice"):
        with turns.turn(1, timeout_s=1.0):
            pass
