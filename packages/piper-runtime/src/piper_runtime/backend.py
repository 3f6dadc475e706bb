"""Device backends: the seam between the executor and the hardware.

The executor only asks a ``Backend`` which torch device to use and which
``torch.distributed`` backend carries point-to-point traffic. ``cpu`` (gloo) is the tested
path. ``cuda`` is a placeholder for the planned cupy-stream / NCCL backend: for now it maps to
torch's NCCL process group with one GPU per rank and runs the same sequential executor.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class Backend:
    name: str  # "cpu" | "cuda"
    dist_backend: str  # torch.distributed backend name
    gpus_per_rank: float = 0.0

    def device(self) -> torch.device:
        # Ray sets CUDA_VISIBLE_DEVICES per actor, so each rank sees its GPU as cuda:0.
        return torch.device("cuda", 0) if self.name == "cuda" else torch.device("cpu")


def resolve_backend(name: str) -> Backend:
    """The backend called ``name``; raises for unknown names or an unusable CUDA backend."""
    if name == "cpu":
        return Backend("cpu", "gloo")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise NotImplementedError(
                "backend='cuda' needs a CUDA-capable torch and a GPU (torch.cuda.is_available() is "
                "False here); the cupy stream/NCCL backend is not implemented yet, use backend='cpu'"
            )
        return Backend("cuda", "nccl", gpus_per_rank=1.0)
    raise ValueError(f"unknown backend {name!r}; expected 'cpu' or 'cuda'")
