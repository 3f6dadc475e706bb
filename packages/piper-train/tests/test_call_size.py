"""How many steps ``fit`` sends per call (``piper_train.call_size``)."""

from __future__ import annotations

import pytest

from piper_train.call_size import (
    AUTO,
    AUTO_CALL_BYTES,
    AUTO_CALL_S,
    AUTO_MAX_STEPS,
    AUTO_MEASURED_STEPS,
    CallSize,
    parse_steps_per_call,
)


def test_a_fixed_size_is_kept_whatever_the_pace() -> None:
    size = CallSize(4)
    for _ in range(10):
        assert size.next() == 4
        size.observe(0.001, 4)


def test_auto_measures_single_steps_then_fills_about_half_a_second() -> None:
    size = CallSize(AUTO)
    for seconds in (9.0, 0.1, 0.1):  # the first step (workers warming up) is not the pace
        assert size.next() == 1
        size.observe(seconds, 1)
    assert AUTO_MEASURED_STEPS == 3
    assert AUTO_CALL_S == 0.5
    assert size.next() == int(AUTO_CALL_S / 0.1) == 5
    size.observe(0.09, 5)  # faster per step in bigger calls: the median moves, within the cap
    assert size.next() == 5


def test_auto_runs_slow_steps_one_per_call_and_caps_fast_ones() -> None:
    slow, fast = CallSize(AUTO), CallSize(AUTO)
    for _ in range(4):
        slow.observe(0.6, 1)
        fast.observe(1e-5, 1)
    assert slow.next() == 1
    assert fast.next() == AUTO_MAX_STEPS


def test_one_slow_step_does_not_swing_the_pace() -> None:
    size = CallSize(AUTO)
    for seconds in (10.0, 0.1, 0.1, 0.1, 0.1, 5.0):  # 5.0: a step before an evaluation
        size.observe(seconds, 1)
    assert size.next() == 5


def test_auto_calls_end_at_a_size_in_bytes_and_fixed_ones_do_not() -> None:
    auto, fixed = CallSize(AUTO), CallSize(8)
    assert not auto.full(AUTO_CALL_BYTES - 1) and auto.full(AUTO_CALL_BYTES)
    assert not fixed.full(100 * AUTO_CALL_BYTES)
    assert not CallSize(AUTO, single=True).full(100 * AUTO_CALL_BYTES)  # one step a call anyway


def test_a_step_that_may_be_undone_goes_alone() -> None:
    size = CallSize(AUTO, single=True)
    for _ in range(5):
        size.observe(0.001, 1)
    assert size.next() == 1


@pytest.mark.parametrize(("text", "value"), [("auto", AUTO), ("1", 1), ("8", 8)])
def test_the_command_line_value(text: str, value: int | str) -> None:
    assert parse_steps_per_call(text) == value


@pytest.mark.parametrize("bad", ["0", "-2", "fast", "1.5"])
def test_a_bad_command_line_value_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_steps_per_call(bad)
    with pytest.raises(ValueError, match="steps_per_call"):
        CallSize(0)
