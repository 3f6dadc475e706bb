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
"""

from __future__ import annotations

from piper_semantics.randomness import seeded, yielding

__all__ = ["seeded", "yielding"]
