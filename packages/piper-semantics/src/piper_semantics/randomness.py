"""Random numbers as a function of (seed, segment, microbatch, step, shard).

A strategy runs a segment's forward for one microbatch wherever and whenever its schedule
says, so a process-wide random stream would give each forward different numbers under
different strategies. Instead each forward (and the recomputation of a forward, which must
redraw the same dropout masks) runs with the generators seeded by
``piper_ir.rng_seed(seed, segment, microbatch, step, shard)`` and restored afterwards
(``seeded``), ``shard`` being the data-parallel replica's shard of the microbatch (0 without
data parallelism). The runtime runs every forward so; single-device training reseeds the
same way where each captured segment starts (``piper_directives.randomness.seeded_regions``,
on ``forked`` and ``reseed``), so dropout gives every strategy the masks of one device.
Masks are equal on the same device type (CPU and CUDA generators differ).

The generators are process-wide, so a seeded region holds a process-wide lock: two seeded
forwards of one process never interleave (a backward running at the same time draws
nothing; one that recomputes a forward takes the lock too). A forward that waits for
another thread's forward (ranks run as threads, meeting in a tensor-parallel collective)
waits inside ``yielding()``, which lets the other thread in and then puts this one's
generators back as they were.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from piper_ir import rng_seed

__all__ = ["forked", "reseed", "seeded", "yielding"]

_LOCK = threading.RLock()
# Per thread: one entry per seeded region it is inside, the CUDA device that region seeded
# (or None): what ``yielding`` releases and whose generators it saves.
_REGIONS = threading.local()


def _regions() -> list[torch.device | None]:
    regions: list[torch.device | None] | None = getattr(_REGIONS, "stack", None)
    if regions is None:
        regions = _REGIONS.stack = []
    return regions


def _cuda(device: torch.device | None) -> torch.device | None:
    return device if device is not None and device.type == "cuda" else None


def reseed(value: int, device: torch.device | None = None) -> None:
    """Seed the CPU generator (and ``device``'s, if it is a CUDA device) with ``value``."""
    torch.default_generator.manual_seed(value)
    cuda = _cuda(device)
    if cuda is not None:
        torch.cuda.default_generators[cuda.index or 0].manual_seed(value)


@contextmanager
def forked(device: torch.device | None = None) -> Iterator[None]:
    """A seeded region without the seeding: the body holds the lock, and the CPU generator
    (and ``device``'s, if CUDA) are restored afterwards; the body reseeds (``reseed``)."""
    cuda = _cuda(device)
    with _LOCK, torch.random.fork_rng(devices=[cuda] if cuda is not None else [], device_type="cuda"):
        regions = _regions()
        regions.append(cuda)
        try:
            yield
        finally:
            regions.pop()


@contextmanager
def seeded(
    seed: int, segment: str, microbatch: int, step: int, shard: int = 0, device: torch.device | None = None
) -> Iterator[None]:
    """Run the body (one segment's forward on one microbatch) with the CPU generator (and
    ``device``'s, if it is a CUDA device) seeded for this key; the generators' previous
    states are restored afterwards, so code outside sees no difference."""
    with forked(device):
        reseed(rng_seed(seed, segment, microbatch, step, shard), device)
        yield


@contextmanager
def yielding() -> Iterator[None]:
    """Run the body (a wait for another thread) outside the calling thread's seeded regions.

    Inside ``seeded``, a forward that waits for the same forward on another rank (a thread of
    this process, in a collective) would deadlock: the other thread needs the lock to run it.
    So this saves the generators the enclosing regions seeded, releases the lock as many times
    as they took it, runs the body, takes the lock back as often and restores the generators:
    what the forward draws after the wait is what it would have drawn without it. Outside
    ``seeded`` it does nothing. (Regions of two threads that yield to each other may end out
    of order, so the generators' state outside seeded regions is then not preserved.)
    """
    regions = _regions()
    if not regions:
        yield
        return
    devices = {d for d in regions if d is not None}
    cpu = torch.get_rng_state()
    cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
    _REGIONS.stack = []  # the body may enter seeded regions of its own
    for _ in regions:
        _LOCK.release()
    try:
        yield
    finally:
        for _ in regions:
            _LOCK.acquire()
        _REGIONS.stack = regions
        torch.set_rng_state(cpu)
        for d, state in cuda.items():
            torch.cuda.set_rng_state(state, d)
