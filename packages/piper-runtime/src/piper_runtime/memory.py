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

from collections.abc import Iterable, Mapping

import attrs
import torch

CATEGORIES = ("parameters", "gradients", "optimizer_state", "communication", "activations")


@attrs.frozen
class RankMemory:
    """One rank's peak bytes over one step, per category, and the peak of their sum (taken at
    one moment, so ``total`` <= the sum of the per-category peaks)."""

    rank: int
    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    communication: int = 0
    activations: int = 0
    total: int = 0

    @property
    def model_state(self) -> int:
        """Peak parameters + gradients + optimizer state (each at its own peak)."""
        return self.parameters + self.gradients + self.optimizer_state


def storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """What identifies ``t``'s storage (``None`` for an empty one)."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (str(t.device), storage.data_ptr())


class MemoryTracker:
    """Peak bytes per category over samples; ``reset`` starts a new step."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.excluded: set[tuple[str, int]] = set()
        self.reset()

    def reset(self, excluded: Iterable[torch.Tensor] = ()) -> None:
        """Forget the peaks; ``excluded`` tensors' storages (the batch) are never counted."""
        self.peaks = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.excluded = {k for t in excluded if (k := storage_key(t)) is not None}

    def sample(self, held: Mapping[str, Iterable[torch.Tensor | None]]) -> None:
        """Count what is held now: category -> tensors (``None`` entries are skipped)."""
        seen = set(self.excluded)
        total = 0
        for category in CATEGORIES:
            size = 0
            for t in held.get(category, ()):
                if t is None:
                    continue
                key = storage_key(t)
                if key is None or key in seen:
                    continue
                seen.add(key)
                size += t.untyped_storage().nbytes()
            self.peaks[category] = max(self.peaks[category], size)
            total += size
        self.peak_total = max(self.peak_total, total)

    def result(self) -> RankMemory:
        return RankMemory(self.rank, **self.peaks, total=self.peak_total)
