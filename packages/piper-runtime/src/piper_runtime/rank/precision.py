"""``Program.precision``: stage segments compute in a low dtype on fp32 master weights.

The parameters keep their own (master) dtype, so gradient accumulation, data-parallel
reductions, ZeRO shards, the optimizer and its state all work in it. A stage segment's
forward runs its module on cast copies of its floating parameters and buffers
(``torch.func.functional_call``: nothing in the module changes, and autograd casts the
gradients back); floating batch inputs are cast once, on the driver, where the batch is read
(``compute_inputs``); values between segments already are in the compute dtype (capture
recorded them so), and the loss module casts the model's outputs up itself
(``piper_directives.capturing.LossModule``). ``piper_directives.precision`` is the same
recipe for single-device training; the two must stay equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from piper_ir import Precision


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def cast_forward(module: nn.Module, args: Sequence[object], compute: torch.dtype) -> object:
    """``module(*args)`` with every floating parameter and buffer cast to ``compute``."""
    # One cast copy per *name*, tied names included: each use of a tied parameter casts its
    # gradient back to the master dtype on its own, as it does when its holders are separate
    # segments (a shared bf16 copy would sum the uses' gradients in bf16 first).
    state = {
        name: t.to(compute) if t.is_floating_point() else t
        for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    }
    return torch.func.functional_call(module, state, tuple(args), strict=False, tie_weights=False)


def compute_inputs(precision: Precision | None, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Floating batch inputs of the master dtype in the compute dtype (token ids unchanged)."""
    if precision is None:
        return tuple(tensors)
    compute, master = dtype_of(precision.compute), dtype_of(precision.master)
    return tuple(t.to(compute) if t.dtype == master else t for t in tensors)
