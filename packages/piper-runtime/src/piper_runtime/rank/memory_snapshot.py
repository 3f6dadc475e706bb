"""CUDA's memory history of a profiled step (``ExecutionOptions.memory_snapshot`` on a GPU).

``torch.cuda.memory._record_memory_history`` records every allocation and free with its stack
while the step runs; ``_snapshot()`` returns it as plain data (dicts, lists, strings and
numbers), which travels as JSON text and is written where the step's profile goes, in the
format https://pytorch.org/memory_viz reads (piper_train.metrics.ProfileWriter). On the CPU
the step's memory over time comes from Piper's own accounting instead
(``MemoryTracker.record_timeline``). Built on torch's documented recipe; no GPU has been lent
to this project, so this path is unverified on hardware.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import torch

MAX_ENTRIES = 100_000  # allocation events kept (torch's ring buffer)


@contextlib.contextmanager
def cuda_history(active: bool) -> Iterator[list[str | None]]:
    """Record CUDA's memory history for the block when ``active``; the list it yields holds
    the snapshot (JSON text) afterwards, else None."""
    out: list[str | None] = [None]
    if not active:
        yield out
        return
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
    try:
        yield out
        out[0] = json.dumps(torch.cuda.memory._snapshot(), default=str)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
