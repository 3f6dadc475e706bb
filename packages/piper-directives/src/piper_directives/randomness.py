"""Randomness as a function of (seed, segment, microbatch, step): the same dropout masks under
every strategy as in single-device training.

The rule, and ``seeded`` (one segment's forward on one microbatch, as the runtime runs every
forward), is ``piper_semantics.randomness``; ``seeded`` is re-exported here. Single-device
training (piper_train.reference) runs the user's own model under ``seeded_regions(...)``,
which reseeds exactly as ``seeded`` does at the region boundary where each captured segment
starts (``CapturedModel.runs`` maps boundaries to segment ids) and draws nothing else
differently. ``shard`` is the data-parallel replica's shard of the microbatch (0 without
data parallelism): a replica draws its own shard's masks, so single-device training must run
a microbatch as the same shards to draw the same masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import attrs
import torch

from piper_directives.annotate import on_boundaries
from piper_directives.regions import ModuleRegions
from piper_ir import rng_seed
from piper_semantics.randomness import forked, reseed, seeded

__all__ = ["Randomness", "seeded", "seeded_regions"]


@contextmanager
def seeded_regions(
    seed: int,
    runs: Mapping[int, str],
    microbatch: int,
    step: int,
    shard: int = 0,
    device: torch.device | None = None,
) -> Iterator[None]:
    """Run the user's model eagerly (single device) drawing what the captured segments draw:
    at each region boundary that starts a segment (``runs``: boundary number -> segment id,
    from ``CapturedModel.runs``), reseed as ``seeded`` does for that segment. Boundaries that
    start no segment (a region holding no operation) leave the generators alone."""
    crossed = 0

    def boundary() -> None:
        nonlocal crossed
        crossed += 1
        segment = runs.get(crossed)
        if segment is not None:
            reseed(rng_seed(seed, segment, microbatch, step, shard), device)

    with forked(device), on_boundaries(boundary):
        yield


@attrs.frozen
class Randomness:
    """What single-device training needs to draw a captured model's random numbers: the seed,
    ``CapturedModel.runs`` (region boundary -> segment id) and, for regions named by module
    path, ``CapturedModel.regions``, whose hooks the model must run with (``install``) to
    cross the same boundaries."""

    seed: int
    runs: tuple[tuple[int, str], ...] = attrs.field(converter=lambda runs: tuple(sorted(dict(runs).items())))
    module_regions: ModuleRegions | None = None

    def install(self, model: torch.nn.Module) -> None:
        """Give ``model`` (single-device training's own copy) the regions' hooks, if any."""
        if self.module_regions is not None:
            self.module_regions.install(model)

    def regions(
        self, microbatch: int, step: int, shard: int = 0, device: torch.device | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """``seeded_regions`` for the user's model on one (microbatch, step, shard)."""
        return seeded_regions(self.seed, dict(self.runs), microbatch, step, shard, device)

    def loss(
        self, microbatch: int, step: int, shard: int = 0, device: torch.device | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """``seeded`` for the loss segment on one (microbatch, step, shard)."""
        return seeded(self.seed, "loss", microbatch, step, shard, device)
