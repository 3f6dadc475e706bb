"""``seeded``: random numbers as a function of (seed, segment, microbatch, step, shard) that
leave the generators as they were; ``yielding``: a thread waiting inside ``seeded`` lets
another thread's seeded region run and then draws what it would have drawn anyway."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from piper_ir import rng_seed
from piper_semantics.randomness import forked, reseed, seeded, yielding

Key = tuple[int, str, int, int, int]
WAIT_S = 10.0


def _mask(seed: int = 0, segment: str = "s0", microbatch: int = 0, step: int = 0, shard: int = 0) -> torch.Tensor:
    with seeded(seed, segment, microbatch, step, shard):
        return F.dropout(torch.ones(64), 0.5)


def test_every_key_field_changes_the_seed_and_the_masks():
    keys = list(itertools.product((0, 1), ("s0", "s1"), (0, 1), (0, 1), (0, 1)))
    seeds = {rng_seed(*k) for k in keys}
    assert len(seeds) == len(keys) and all(0 <= s < 2**63 for s in seeds)
    assert len({tuple(_mask(*k).tolist()) for k in keys}) == len(keys)


def test_the_draws_are_those_of_a_generator_seeded_by_rng_seed():
    for key in ((7, "s0", 0, 0, 0), (7, "s3", 2, 5, 1), (7, "loss", 1, 0, 0)):
        with seeded(*key):
            got = torch.rand(5)
        want = torch.rand(5, generator=torch.Generator().manual_seed(rng_seed(*key)))
        assert torch.equal(got, want)


def test_the_same_key_gives_the_same_mask_and_the_generator_is_restored():
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    first = _mask(microbatch=3, step=2)
    assert torch.equal(torch.rand(4), expected)  # as if nothing had been drawn
    assert torch.equal(_mask(microbatch=3, step=2), first)


def test_forked_and_reseed_are_seeded_in_two_steps():
    with forked():
        reseed(rng_seed(3, "s1", 2, 1, 0))
        got = torch.rand(6)
    with seeded(3, "s1", 2, 1):
        assert torch.equal(torch.rand(6), got)


def _in_regions(keys: list[Key], body: Callable[[], None], device: torch.device | None = None) -> None:
    """``body`` inside nested seeded regions, one per key."""
    if not keys:
        body()
        return
    with seeded(*keys[0], device=device):
        _in_regions(keys[1:], body, device)


def _uninterrupted(keys: list[Key], sizes: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
    drawn: list[torch.Tensor] = []
    _in_regions(keys, lambda: drawn.extend(torch.rand(n, device=device) for n in sizes), device)
    return torch.cat(drawn)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch.cuda.is_available() is False here")


@pytest.mark.parametrize("device", [None, pytest.param(torch.device("cuda", 0), marks=CUDA, id="cuda")])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_thread_waiting_inside_seeded_lets_another_draw_and_then_draws_its_own_numbers(
    depth: int, device: torch.device | None
):
    """A draws, waits inside ``yielding`` (all ``depth`` levels of the lock released) until B
    has run a seeded region of its own and drawn unseeded, then draws more: each draws what
    it draws alone (on the CPU, or on ``device``'s generator)."""
    keys_a: list[Key] = [(7, "s0", 1, 2, 0), (7, "s1", 1, 2, 0)][:depth]
    key_b: Key = (7, "s0", 1, 2, 1)
    want_a, want_b = _uninterrupted(keys_a, (3, 4), device), _uninterrupted([key_b], (5,), device)
    a_waiting, b_done = threading.Event(), threading.Event()
    got: dict[str, torch.Tensor] = {}
    errors: list[str] = []

    def a_body() -> None:
        first = torch.rand(3, device=device)
        with yielding():
            a_waiting.set()
            if not b_done.wait(WAIT_S):
                errors.append("B never ran its seeded region while A waited inside yielding()")
        got["a"] = torch.cat([first, torch.rand(4, device=device)])

    def b() -> None:
        if not a_waiting.wait(WAIT_S):
            errors.append("A never reached yielding()")
        with seeded(*key_b, device=device):
            got["b"] = torch.rand(5, device=device)
        torch.rand(3, device=device)  # an unseeded draw moves the process-wide generator A resumes from
        b_done.set()

    threads = [threading.Thread(target=_in_regions, args=(keys_a, a_body, device)), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * WAIT_S)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert torch.equal(got["a"], want_a)
    assert torch.equal(got["b"], want_b)


def test_yielding_outside_seeded_does_nothing():
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    with yielding():  # no lock to release (releasing an unheld one would raise), no state restored
        first = torch.rand(2)
    assert torch.equal(torch.cat([first, torch.rand(2)]), want)


def test_a_seeded_region_inside_yielding_is_a_region_of_its_own():
    with seeded(1, "s0", 0, 0):
        before = torch.rand(2)
        with yielding():
            inner = _mask(seed=2)
        after = torch.rand(2)
    assert torch.equal(inner, _mask(seed=2))
    assert torch.equal(torch.cat([before, after]), _uninterrupted([(1, "s0", 0, 0, 0)], (2, 2)))
