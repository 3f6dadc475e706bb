"""piper-memory: ZeRO planning (``plan_memory``) and memory estimates for Piper programs.

This package imports only ``piper_ir``; the torch-side flat-buffer shard store is
``piper_memory.store``, imported on its own by a runtime.
"""

from importlib.metadata import PackageNotFoundError, version

from piper_memory.estimate import OPTIMIZER_STATE_FACTOR, MemoryEstimate, check_budget, estimate_memory
from piper_memory.grad_norm import add_grad_norm, norm_terms
from piper_memory.plan import plan_memory, zero_residency

try:
    __version__ = version("piper-memory")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "OPTIMIZER_STATE_FACTOR", "MemoryEstimate", "add_grad_norm", "check_budget", "estimate_memory", "norm_terms",
    "plan_memory", "zero_residency",
]
