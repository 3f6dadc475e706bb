"""``backend="cuda"``: registered, not built yet.

The CUDA backend (cupy streams and events, NCCL communicators, one GPU per rank) implements
``piper_runtime.backends.base.Backend`` and replaces this factory; until then asking for it
fails at once, in the driver, with what is missing.
"""

from __future__ import annotations

import torch

from piper_runtime.backends.base import Backend


def cuda_backend() -> Backend:
    """Raises ``NotImplementedError``: there is no CUDA backend yet."""
    gpu = (
        "a GPU is visible here"
        if torch.cuda.is_available()
        else "torch.cuda.is_available() is False here (no GPU or a CPU-only torch)"
    )
    raise NotImplementedError(
        f"backend='cuda' is not available yet: the CUDA backend (cupy streams and events, NCCL "
        f"communicators) is not implemented ({gpu}); use backend='cpu'"
    )
