"""Explicit precision (``--precision bf16``): compute in a low dtype, keep fp32 master state.

The recipe itself (``cast_forward``, the input and output casts, dtype names) is
``piper_semantics.precision``, the one the runtime's segments run too; its names are
re-exported here. This module adds what capture and single-device training need on top:
``precision_of`` (a ``Precision`` from a user's name for it) and ``PrecisionModel``, the
recipe applied to a whole model, so the reference runs exactly the operations the captured
segments run, in the same dtypes.
"""

from __future__ import annotations

import torch
from torch import nn

from piper_ir import CaptureError, Precision
from piper_semantics.precision import cast_forward, cast_inputs, dtype_name, torch_dtype, upcast

__all__ = ["PrecisionModel", "cast_forward", "cast_inputs", "dtype_name", "precision_of", "torch_dtype", "upcast"]

_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32", "fp64": "float64", "float64": "float64"}


def precision_of(name: str, master: torch.dtype) -> Precision:
    """``Precision`` from a name (``bf16``, ``fp16``, ``fp32``, ``fp64``; or the dtype's own
    name) and the model's parameter dtype (the master dtype).

    ``fp64`` is not a recipe on lower-precision master weights: a float64 run holds and
    updates its parameters in float64, so it needs a float64 model (a no-op recipe then);
    ``piper check --precision fp64`` (``piper_train.check.in_float64``) converts a copy of the
    model and its data before capture. Computing in float64 from fp32 master weights, whose
    gradients and updates round to fp32, would look like fp64 and check like fp32: refused."""
    compute = _NAMES.get(name)
    if compute is None:
        raise CaptureError(f"unknown precision {name!r}; use one of bf16, fp16, fp32, fp64")
    if compute == "float64" and master != torch.float64:
        raise CaptureError(
            f"precision {name!r} needs a float64 model: its parameters are {dtype_name(master)}, and float64 "
            "compute on them would still round every gradient and update to that dtype. Convert the model and "
            "the floating batch tensors (model.double()), or use `piper check --precision fp64`, which does so "
            "for both the strategy and the single-device reference"
        )
    return Precision(compute=compute, master=dtype_name(master))


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
