"""What one rank changes in the process it runs in, and puts back: torch's intra-op threads, the
GIL hand-over interval, the default dtype, the generators.

A Ray worker process serves one rank at a time and may be reused (``RankWorker.reset``); the
``local`` runtime's ranks share the driver's process. Either way what a run changed must be
restorable to what the process had before it (``ProcessSettings``).
"""

from __future__ import annotations

import sys

import attrs
import torch

TORCH_THREADS = 1  # torch's intra-op threads per rank (ranks share the machine's cores)
SWITCH_INTERVAL_S = 0.0005  # the GIL hand-over interval with threads (Python's default: 5 ms)


@attrs.frozen
class ProcessSettings:
    """Process-wide settings a run may change, as read when the worker started."""

    switch_interval: float
    threads: int
    dtype: torch.dtype

    @classmethod
    def read(cls) -> ProcessSettings:
        return cls(sys.getswitchinterval(), torch.get_num_threads(), torch.get_default_dtype())

    def restore(self) -> None:
        sys.setswitchinterval(self.switch_interval)
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.seed()  # a new process's generators are seeded at random too


def rng_state(device: torch.device) -> dict[str, torch.Tensor | None]:
    """This process's generators (what unseeded draws come from), for a checkpoint."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
