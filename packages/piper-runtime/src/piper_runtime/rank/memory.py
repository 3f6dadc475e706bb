"""Memory accounting: per-rank peak bytes of the tensors Piper owns, by category.

The worker tells a ``MemoryTracker`` what it holds, category by category, after every
instruction (and inside collectives, while their buffers are alive); the tracker sums the
bytes of the distinct storages and keeps the peak of each category and of their total over
the step. Each storage is counted once, in the first category (in ``CATEGORIES`` order) that
holds it: a weight autograd saved for backward is a parameter, not an activation; a bucket's
gathered buffer is communication even though the module's parameters are views of it.

Categories:

- ``parameters``: module parameters, and the flat parameter shards the optimizer steps;
- ``gradients``: parameter gradients (full ``.grad`` and accumulated gradient shards);
- ``optimizer_state``: tensors in the optimizers' state (AdamW's moments and step counts);
- ``communication``: buffers of collectives (flattened buckets, gathered parameters),
  posted receive buffers, unfinished sends and received values still held;
- ``activations``: what a forward keeps for its backward (the tensors autograd saves, the
  segment's inputs and outputs), local values waiting to be consumed and activation
  gradients.

The batch the driver ships is the user's data, not Piper's: its storages are excluded.
Memory inside a module's forward (temporaries autograd does not save) is not seen.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import attrs
import torch

CATEGORIES = ("parameters", "gradients", "optimizer_state", "communication", "activations")
MODEL_STATE = CATEGORIES[:3]


@attrs.frozen
class RankMemory:
    """One rank's peak bytes over one step, per category, and the peak of their sum (taken at
    one moment, so ``total`` <= the sum of the per-category peaks). ``device_peak``: on a GPU,
    the CUDA caching allocator's own peak of allocated bytes over the step (everything the
    process allocated, temporaries inside a forward included); 0 on the CPU."""

    rank: int
    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    communication: int = 0
    activations: int = 0
    total: int = 0
    device_peak: int = 0

    @property
    def model_state(self) -> int:
        """Peak parameters + gradients + optimizer state (each at its own peak)."""
        return self.parameters + self.gradients + self.optimizer_state


def storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """What identifies ``t``'s storage (``None`` for an empty one)."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (t.get_device(), storage.data_ptr())


class MemoryTracker:
    """Peak bytes per category over samples; ``reset`` starts a new step."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.excluded: set[tuple[int, int]] = set()
        self.reset()

    def reset(self, excluded: Iterable[torch.Tensor] = ()) -> None:
        """Forget the peaks; ``excluded`` tensors' storages (the batch) are never counted."""
        self.origin: float | None = None  # with a time origin, every sample is kept (``record_timeline``)
        self.timeline: list[tuple[float, tuple[int, ...]]] = []
        self.peaks = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.excluded = {k for t in excluded if (k := storage_key(t)) is not None}
        self._model_state: tuple[dict[str, int], set[tuple[int, int]]] = (dict.fromkeys(MODEL_STATE, 0), set())

    def sample(self, held: Mapping[str, Iterable[torch.Tensor | None]], *, model_state: bool = True) -> None:
        """Count what is held now: category -> tensors (``None`` entries are skipped).

        With ``model_state=False`` the model-state categories (``MODEL_STATE``) are taken
        from the previous sample instead of ``held``: counting every parameter, gradient and
        optimizer tensor after every instruction dominated the cost of a step.
        """
        if model_state:
            seen = set(self.excluded)
            sizes = {c: self._count(held.get(c, ()), seen) for c in MODEL_STATE}
            self._model_state = (sizes, seen - self.excluded)
        sizes, model_keys = self._model_state
        seen = self.excluded | model_keys
        now = tuple(
            sizes[category] if category in MODEL_STATE else self._count(held.get(category, ()), seen)
            for category in CATEGORIES
        )
        for category, size in zip(CATEGORIES, now, strict=True):
            self.peaks[category] = max(self.peaks[category], size)
        self.peak_total = max(self.peak_total, sum(now))
        if self.origin is not None:
            self.timeline.append((time.perf_counter() - self.origin, now))

    def record_timeline(self, origin: float) -> None:
        """Keep every sample of this step, as (seconds since ``origin``, bytes per category in
        ``CATEGORIES`` order): the step's memory over time (``--memory-snapshot``)."""
        self.origin = origin

    @staticmethod
    def _count(tensors: Iterable[torch.Tensor | None], seen: set[tuple[int, int]]) -> int:
        """Bytes of the storages of ``tensors`` not in ``seen`` (which it extends)."""
        size = 0
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0:
                continue
            key = (t.get_device(), storage.data_ptr())  # get_device: -1 on the CPU
            if key in seen:
                continue
            seen.add(key)
            size += nbytes
        return size

    def result(self) -> RankMemory:
        return RankMemory(self.rank, **self.peaks, total=self.peak_total)
