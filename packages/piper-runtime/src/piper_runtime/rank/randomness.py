"""Random numbers as a function of (seed, segment, microbatch, step, shard).

A strategy runs a segment's forward for one microbatch wherever and whenever its schedule
says, so a process-wide random stream would give each forward different numbers under
different strategies. Instead each forward (and the recomputation of a forward, which must
redraw the same dropout masks) runs with the generators seeded by
``piper_ir.rng_seed(seed, segment, microbatch, step, shard)`` and restored afterwards,
``shard`` being the rank's data-parallel replica index (``RankPlan.replica``): a replica
draws its own batch shard's numbers. ``piper_directives.randomness`` draws the same numbers
in single-device training (its ``seeded`` is this function; a test keeps the two equal), so
dropout gives every strategy the masks of one device.

The generators are process-wide: ``seeded`` holds a lock, so two seeded forwards of one
process never interleave (a backward running at the same time draws nothing; one that
recomputes a forward takes the lock too). A backend that runs several ranks in one process
(threads) cannot seed forwards that wait on each other inside collectives (tensor or expert
parallelism) under that lock; its workers are set up with ``seed=None``, which draws
unseeded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from piper_ir import rng_seed

_LOCK = threading.RLock()


@contextmanager
def seeded(
    seed: int, segment: str, microbatch: int, step: int, shard: int = 0, device: torch.device | None = None
) -> Iterator[None]:
    """Run the body with the CPU generator (and ``device``'s, if it is a CUDA device) seeded
    for this key; their previous states are restored afterwards."""
    cuda = [device] if device is not None and device.type == "cuda" else []
    with _LOCK, torch.random.fork_rng(devices=cuda, device_type="cuda"):
        value = rng_seed(seed, segment, microbatch, step, shard)
        torch.default_generator.manual_seed(value)
        if cuda:
            torch.cuda.default_generators[cuda[0].index or 0].manual_seed(value)
        yield
