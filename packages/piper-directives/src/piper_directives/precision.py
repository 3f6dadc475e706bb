"""Explicit precision (``--precision bf16``): compute in a low dtype, keep fp32 master state.

The parameters stay in their own (master) dtype: the optimizer, its state, gradient
accumulation over microbatches, data-parallel reductions and ZeRO shards all see fp32. Each
forward runs the module on *cast copies* of its floating parameters and buffers
(``cast_forward``, via ``torch.func.functional_call``: nothing in the module changes, so a
runtime may use it from several threads); autograd casts their gradients back to the master
dtype. Floating batch inputs are cast once where the batch is read, and the loss is computed
in the master dtype from outputs cast up (``LossModule(master=...)``), the usual mixed
precision recipe. Values segments exchange are in the compute dtype (``capture`` records
them so), which halves pipeline traffic.

``PrecisionModel`` applies the same recipe to a whole model for single-device training, so
the reference runs exactly the operations the captured segments run, in the same dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from piper_ir import CaptureError, Precision

_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32", "fp64": "float64", "float64": "float64"}


def precision_of(name: str, master: torch.dtype) -> Precision:
    """``Precision`` from a name (``bf16``, ``fp16``, ``fp32``; or the dtype's own name) and
    the model's parameter dtype (the master dtype)."""
    compute = _NAMES.get(name)
    if compute is None:
        raise CaptureError(f"unknown precision {name!r}; use one of bf16, fp16, fp32")
    return Precision(compute=compute, master=dtype_name(master))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def cast_forward(module: nn.Module, args: Sequence[object], compute: torch.dtype) -> object:
    """``module(*args)`` with every floating parameter and buffer cast to ``compute``.

    Gradients reach the original (master) parameters through the casts, in their dtype.
    ``args`` are passed as they are: values between segments already have the compute dtype,
    and batch inputs are cast where the batch is read (``cast_inputs``).
    """
    # One cast copy per *name*, tied names included: each use of a tied parameter casts its
    # gradient back to the master dtype on its own, as it does when its holders are separate
    # segments (a shared bf16 copy would sum the uses' gradients in bf16 first).
    state = {
        name: t.to(compute) if t.is_floating_point() else t
        for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    }
    return torch.func.functional_call(module, state, tuple(args), strict=False, tie_weights=False)


def cast_inputs(tensors: Sequence[torch.Tensor], compute: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Floating batch inputs in the compute dtype; integer ones (token ids) unchanged."""
    return tuple(t.to(compute) if t.is_floating_point() else t for t in tensors)


def upcast(tensors: Sequence[torch.Tensor], master: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Floating model outputs in the master dtype, for the loss."""
    return tuple(t.to(master) if t.is_floating_point() else t for t in tensors)


class PrecisionModel(nn.Module):
    """``model`` run with a ``Precision``: inputs and parameters cast to the compute dtype,
    floating outputs cast up to the master dtype (single-device training's half of the
    recipe; the captured segments run the same casts one region at a time)."""

    def __init__(self, model: nn.Module, precision: Precision) -> None:
        super().__init__()
        self.model = model
        self.compute = torch_dtype(precision.compute)
        self.master = torch_dtype(precision.master)

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out = cast_forward(self.model, cast_inputs(args, self.compute), self.compute)
        if isinstance(out, torch.Tensor):
            return upcast((out,), self.master)[0]
        return upcast(tuple(out), self.master)  # type: ignore[arg-type]
