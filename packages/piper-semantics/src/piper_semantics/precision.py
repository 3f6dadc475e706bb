"""The mixed-precision recipe (``piper_ir.Precision``): compute in a low dtype on master weights.

Single-device training (``piper_directives.precision.PrecisionModel``) and the runtime's stage
segments both run it, from here, so the reference does the operations the segments do, in the
same dtypes:

- the parameters keep their own (master) dtype, so gradient accumulation, data-parallel
  reductions, ZeRO shards, the optimizer and its state all work in it;
- a forward runs its module on cast copies of its floating parameters and buffers
  (``cast_forward``, via ``torch.func.functional_call``: nothing in the module changes, so
  several threads may use it at once); autograd casts the gradients back to the master dtype;
- floating batch inputs are cast once, where the batch is read (``cast_inputs``,
  ``compute_inputs``); values between segments already are in the compute dtype (capture
  records them so), which halves pipeline traffic;
- the loss is computed in the master dtype from outputs cast up (``upcast``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from piper_ir import Precision

__all__ = ["cast_forward", "cast_inputs", "compute_inputs", "dtype_name", "torch_dtype", "upcast"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a ``Precision`` field names (``"bfloat16"``, ``"float32"``, ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name of ``dtype`` as the IR writes it (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def cast_forward(module: nn.Module, args: Sequence[object], compute: torch.dtype) -> object:
    """``module(*args)`` with every floating parameter and buffer cast to ``compute``.

    Gradients reach the original (master) parameters through the casts, in their dtype.
    ``args`` are passed as they are: values between segments already have the compute dtype,
    and batch inputs are cast where the batch is read (``cast_inputs``).
    """
    # One cast copy per *name*, tied names included: each use of a tied parameter casts its
    # gradient back to the master dtype on its own, as it does when its holders are separate
    # segments (a shared low-precision copy would sum the uses' gradients in that dtype first).
    state = {
        name: t.to(compute) if t.is_floating_point() else t
        for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    }
    return torch.func.functional_call(module, state, tuple(args), strict=False, tie_weights=False)


def cast_inputs(tensors: Sequence[torch.Tensor], compute: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Floating batch inputs in the compute dtype; integer ones (token ids) unchanged."""
    return tuple(t.to(compute) if t.is_floating_point() else t for t in tensors)


def compute_inputs(precision: Precision | None, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``cast_inputs`` for a program's ``Precision`` (the batch as it is without one)."""
    if precision is None:
        return tuple(tensors)
    return cast_inputs(tensors, torch_dtype(precision.compute))


def upcast(tensors: Sequence[torch.Tensor], master: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Floating model outputs in the master dtype, for the loss."""
    return tuple(t.to(master) if t.is_floating_point() else t for t in tensors)
