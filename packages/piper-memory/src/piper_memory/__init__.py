"""piper-memory: memory estimates (and, later, ZeRO planning) for Piper programs."""

from importlib.metadata import PackageNotFoundError, version

from piper_memory.estimate import OPTIMIZER_STATE_FACTOR, MemoryEstimate, estimate_memory

try:
    __version__ = version("piper-memory")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = ["OPTIMIZER_STATE_FACTOR", "MemoryEstimate", "estimate_memory"]
