"""``seeded`` / ``seeded_regions``: random numbers as a function of (seed, segment,
microbatch, step, shard), leaving the global random stream alone."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from piper_directives import annotate
from piper_directives.randomness import seeded, seeded_regions
from piper_ir import rng_seed


def _mask(seed=0, segment="s0", microbatch=0, step=0, shard=0) -> torch.Tensor:
    with seeded(seed, segment, microbatch, step, shard):
        return F.dropout(torch.ones(64), 0.5)


def test_every_key_field_changes_the_seed_and_the_masks():
    keys = list(itertools.product((0, 1), ("s0", "s1"), (0, 1), (0, 1), (0, 1)))
    seeds = {rng_seed(*k) for k in keys}
    assert len(seeds) == len(keys) and all(0 <= s < 2**63 for s in seeds)
    masks = {tuple(_mask(*k).tolist()) for k in keys}
    assert len(masks) == len(keys)


def test_the_same_key_gives_the_same_mask_and_the_global_stream_is_untouched():
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    first = _mask(microbatch=3, step=2)
    assert torch.equal(torch.rand(4), expected)  # as if nothing had been drawn
    assert torch.equal(_mask(microbatch=3, step=2), first)
    assert rng_seed(7, "loss", 1, 2, 3) == rng_seed(7, "loss", 1, 2, 3)


def _two_regions(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with annotate("PP"):  # boundary 1
        a = F.dropout(x, 0.5)
    with annotate("PP"):  # boundary 3
        b = F.dropout(x, 0.5)
    return a, b


def test_seeded_regions_reseed_where_segments_start():
    x = torch.ones(64)
    with seeded_regions(9, {1: "s0", 3: "s1"}, microbatch=1, step=4):
        a, b = _two_regions(x)
    with seeded(9, "s0", 1, 4):
        want_a = F.dropout(x, 0.5)
    with seeded(9, "s1", 1, 4):
        want_b = F.dropout(x, 0.5)
    assert torch.equal(a, want_a) and torch.equal(b, want_b) and not torch.equal(a, b)
    a2, b2 = _two_regions(x)  # outside: annotate is free again and draws from the global stream
    assert not torch.equal(a2, a)
