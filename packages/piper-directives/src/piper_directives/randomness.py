"""Randomness as a function of (seed, segment, microbatch, step): the same dropout masks under
every strategy as in single-device training.

A strategy runs a segment's forward for one microbatch wherever and whenever its schedule
says, so a global random stream would hand each (segment, microbatch) different numbers under
different strategies. Instead each forward draws from a generator seeded by
``piper_ir.rng_seed(seed, segment, microbatch, step, shard)`` (pure Python, so a runtime
computes the same number without importing this package):

- a runtime runs every forward (and a recomputed forward, which must redraw the same masks)
  the way ``seeded(...)`` does: fork the generators, seed them with ``rng_seed``, restore
  them (piper-runtime may not import this package, hence the seed function in piper-ir);
- single-device training (piper_train.reference) runs the user's own model under
  ``seeded_regions(...)``, which reseeds at the region boundary where each captured segment
  starts (``CapturedModel.runs`` maps boundaries to segment ids) and draws nothing else
  differently;
- ``shard`` is the data-parallel replica's shard of the microbatch (0 without data
  parallelism): a replica draws its own shard's masks, so single-device training must run a
  microbatch as the same shards to draw the same masks.

Masks are equal on the same device type (CPU and CUDA generators differ). The generators are
process-wide, so ``seeded`` holds a lock: two seeded forwards of one process never interleave
(a runtime overlapping a forward with a backward is unaffected: backward draws nothing).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import attrs
import torch

from piper_directives.annotate import on_boundaries
from piper_ir import rng_seed

_LOCK = threading.RLock()


def _reseed(value: int, device: torch.device | None) -> None:
    torch.default_generator.manual_seed(value)
    if device is not None and device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(value)


@contextmanager
def _forked(device: torch.device | None) -> Iterator[None]:
    cuda = [device] if device is not None and device.type == "cuda" else []
    with _LOCK, torch.random.fork_rng(devices=cuda, device_type="cuda"):
        yield


@contextmanager
def seeded(
    seed: int, segment: str, microbatch: int, step: int, shard: int = 0, device: torch.device | None = None
) -> Iterator[None]:
    """Run the body (one segment's forward on one microbatch) with the CPU generator (and
    ``device``'s, if it is a CUDA device) seeded for this key; the generators' previous
    states are restored afterwards, so code outside sees no difference."""
    with _forked(device):
        _reseed(rng_seed(seed, segment, microbatch, step, shard), device)
        yield


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
            _reseed(rng_seed(seed, segment, microbatch, step, shard), device)

    with _forked(device), on_boundaries(boundary):
        yield


@attrs.frozen
class Randomness:
    """What single-device training needs to draw a captured model's random numbers: the seed
    and ``CapturedModel.runs`` (region boundary -> segment id)."""

    seed: int
    runs: tuple[tuple[int, str], ...] = attrs.field(converter=lambda runs: tuple(sorted(dict(runs).items())))

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
