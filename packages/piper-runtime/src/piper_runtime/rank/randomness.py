"""Random numbers as a function of (seed, segment, microbatch, step, shard).

The rule is ``piper_semantics.randomness`` (single-device training draws from the same
``seeded``); its names are re-exported here. Every forward, and the recomputation of a
forward, runs inside ``seeded(seed, segment, microbatch, step, shard, device)``, ``shard``
being the rank's data-parallel replica index (``RankPlan.replica``): a replica draws its own
batch shard's numbers, and dropout gives every strategy the masks of one device.

``seeded`` holds a process-wide lock (the generators are process-wide). A backend that runs
several ranks in one process (threads) must wait for another rank's forward (a tensor- or
expert-parallel collective) inside ``yielding()``, which releases the lock for the wait and
restores the generators after it.

That lock made the forwards of a process's ranks take turns even where they draw nothing
(most segments: no dropout): on the ``local`` runtime two data-parallel ranks kept 1.0-1.5 of
this machine's two cores busy, their forwards one after the other. ``SeededForwards`` runs a
segment's first forward (in each of training and evaluation mode) seeded and looks at the
generators afterwards: if they are as the seeding left them, the forward drew nothing, and
its later forwards run without the lock and without seeding (nothing they run reads the
generators, so nothing changes). A captured segment runs the same operators every time; a
forward that draws only sometimes (a leaf module branching on its data) would draw unseeded
numbers once it does, which ``PIPER_SEED_EVERY_FORWARD=1`` rules out (every forward seeded,
as before).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from piper_semantics.randomness import seeded, yielding

__all__ = ["SeededForwards", "seeded", "yielding"]

SEED_EVERY_FORWARD_ENV = "PIPER_SEED_EVERY_FORWARD"


class SeededForwards:
    """``seeded`` for one rank's forwards, skipped (no lock) for segments whose first forward
    drew nothing from the process's generators (module doc)."""

    def __init__(self, seed: int, shard: int, device: torch.device | None = None) -> None:
        self.seed = seed
        self.shard = shard
        self.device = device
        self.always = os.environ.get(SEED_EVERY_FORWARD_ENV, "") == "1"
        self.quiet: set[tuple[str, bool]] = set()  # (segment, training): forwards that draw nothing
        self._looked: set[tuple[str, bool]] = set()

    @contextmanager
    def forward(self, segment: str, microbatch: int, step: int, training: bool) -> Iterator[None]:
        """Run the body (``segment``'s forward on ``microbatch``) seeded, unless it draws nothing."""
        key = (segment, training)
        if key in self.quiet:
            yield
            return
        with seeded(self.seed, segment, microbatch, step, self.shard, self.device):
            if key in self._looked or self.always:
                yield
                return
            before = _states(self.device)
            yield
            if all(torch.equal(a, b) for a, b in zip(before, _states(self.device), strict=True)):
                self.quiet.add(key)
            self._looked.add(key)


def _states(device: torch.device | None) -> list[torch.Tensor]:
    """The states of the generators ``seeded`` seeds: the CPU's, and ``device``'s if CUDA."""
    states = [torch.default_generator.get_state()]
    if device is not None and device.type == "cuda":
        states.append(torch.cuda.default_generators[device.index or 0].get_state())
    return states
