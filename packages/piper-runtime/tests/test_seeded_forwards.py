"""``SeededForwards``: a rank's forwards are seeded as ``seeded`` seeds them, except those of
segments whose first forward drew nothing, which then run without the process-wide generator
lock (so ranks that are threads of one process compute side by side) and without touching
the generators."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import piper_semantics.randomness as semantics
from piper_runtime.rank.randomness import SEED_EVERY_FORWARD_ENV, SeededForwards, seeded

WAIT_S = 10.0


def _dropout(forwards: SeededForwards, segment: str, mb: int, step: int, training: bool = True) -> torch.Tensor:
    with forwards.forward(segment, mb, step, training):
        return F.dropout(torch.ones(64), 0.5)


def _quiet(forwards: SeededForwards, segment: str, mb: int, step: int, training: bool = True) -> torch.Tensor:
    with forwards.forward(segment, mb, step, training):
        return torch.ones(4) * 2


def _waits_for_the_lock(body) -> bool:
    """Whether ``body`` (run on a thread) waits while another thread holds the generators' lock."""
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with semantics._LOCK:
            held.set()
            release.wait(WAIT_S)

    other = threading.Thread(target=holder)
    other.start()
    held.wait(WAIT_S)
    runner = threading.Thread(target=body)
    runner.start()
    runner.join(0.3)
    waited = runner.is_alive()
    release.set()
    runner.join(WAIT_S)
    other.join(WAIT_S)
    assert not runner.is_alive()
    return waited


def test_a_forward_that_draws_is_seeded_every_time_as_seeded_seeds_it() -> None:
    forwards = SeededForwards(seed=3, shard=1)
    for mb, step in ((0, 0), (1, 0), (0, 1), (1, 1)):
        got = _dropout(forwards, "s0", mb, step)
        with seeded(3, "s0", mb, step, 1):
            want = F.dropout(torch.ones(64), 0.5)
        assert torch.equal(got, want)
    assert not forwards.quiet
    assert _waits_for_the_lock(lambda: _dropout(forwards, "s0", 2, 2))


def test_a_forward_that_draws_nothing_runs_without_the_lock_after_its_first() -> None:
    forwards = SeededForwards(seed=3, shard=0)
    assert _waits_for_the_lock(lambda: _quiet(forwards, "s1", 0, 0))  # the first looks, seeded
    assert forwards.quiet == {("s1", True)}
    assert not _waits_for_the_lock(lambda: _quiet(forwards, "s1", 1, 0))
    # Its generators are left alone: what is drawn next is what would have been drawn.
    torch.manual_seed(9)
    want = torch.rand(3)
    torch.manual_seed(9)
    _quiet(forwards, "s1", 2, 0)
    assert torch.equal(torch.rand(3), want)


def test_training_and_evaluation_forwards_are_looked_at_apart() -> None:
    forwards = SeededForwards(seed=3, shard=0)
    _quiet(forwards, "s0", 0, 0, training=False)
    assert forwards.quiet == {("s0", False)}
    assert _waits_for_the_lock(lambda: _dropout(forwards, "s0", 0, 0, training=True))
    assert forwards.quiet == {("s0", False)}


def test_a_forward_that_raised_is_looked_at_again() -> None:
    forwards = SeededForwards(seed=3, shard=0)
    with pytest.raises(RuntimeError), forwards.forward("s0", 0, 0, True):
        raise RuntimeError("failed before drawing")
    assert _dropout(forwards, "s0", 0, 0) is not None and not forwards.quiet


def test_every_forward_is_seeded_where_the_environment_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SEED_EVERY_FORWARD_ENV, "1")
    forwards = SeededForwards(seed=3, shard=0)
    _quiet(forwards, "s1", 0, 0)
    assert not forwards.quiet
    assert _waits_for_the_lock(lambda: _quiet(forwards, "s1", 1, 0))
