"""``seeded_regions``: single-device training reseeds where each captured segment starts,
drawing what ``seeded`` draws for that segment (``seeded`` itself, the one rule both sides
use, is tested in packages/piper-semantics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from piper_directives import annotate
from piper_directives.randomness import seeded, seeded_regions


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
