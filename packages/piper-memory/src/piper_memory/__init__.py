"""piper-memory: ZeRO planning (``plan_memory``) and memory estimates for Piper programs.

This package imports only ``piper_ir``; the torch-side flat-buffer shard store is
``piper_memory.store``, imported on its own by a runtime.
"""

from piper_memory._version import __version__ as __version__
from piper_memory.estimate import OPTIMIZER_STATE_FACTOR, MemoryEstimate, check_budget, estimate_memory
from piper_memory.grad_norm import add_grad_norm, norm_terms
from piper_memory.plan import plan_memory, zero_residency

__all__ = [
    "OPTIMIZER_STATE_FACTOR", "MemoryEstimate", "add_grad_norm", "check_budget", "estimate_memory", "norm_terms",
    "plan_memory", "zero_residency",
]
