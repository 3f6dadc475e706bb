"""The mixed-precision recipe: forwards on cast copies, gradients in the master dtype, one
cast per tied name; inputs cast where the batch is read, outputs cast up for the loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from piper_ir import Precision
from piper_semantics.precision import (
    cast_forward,
    cast_inputs,
    compute_inputs,
    dtype_name,
    torch_dtype,
    upcast,
)


class Tied(nn.Module):
    """One weight used by two names (``a.weight`` is ``b.weight``), and a floating buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = (x.dtype, self.a.weight.dtype, self.scale.dtype)
        return self.b(self.a(x)) * self.scale


def test_the_forward_runs_on_cast_copies_and_the_gradients_reach_the_master_params():
    torch.manual_seed(0)
    model = Tied().double()
    x = torch.randn(3, 4, dtype=torch.float32)
    out = cast_forward(model, [x], torch.float32)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert model.seen == (torch.float32, torch.float32, torch.float32)
    assert model.a.weight.dtype == torch.float64 and model.scale.dtype == torch.float64  # nothing changed
    out.sum().backward()
    assert model.a.weight.grad is not None and model.a.weight.grad.dtype == torch.float64


def test_each_tied_name_casts_its_gradient_back_on_its_own():
    """The gradient is the sum of the two uses' gradients, each cast to the master dtype
    first, as when the holders are separate segments (not summed in the compute dtype)."""
    torch.manual_seed(0)
    model = Tied()
    x = torch.randn(8, 4)
    cast_forward(model, [x.bfloat16()], torch.bfloat16).float().sum().backward()
    got = model.a.weight.grad
    # The same forward with the two uses as two separate bf16 copies of the weight.
    w = model.a.weight.detach()
    wa, wb = w.clone().requires_grad_(), w.clone().requires_grad_()
    y = (x.bfloat16() @ wa.bfloat16().T) @ wb.bfloat16().T * model.scale.bfloat16()
    y.float().sum().backward()
    assert torch.equal(got, wa.grad + wb.grad)


def test_inputs_outputs_and_dtype_names():
    ids, x = torch.tensor([1, 2]), torch.randn(2, dtype=torch.float64)
    assert [t.dtype for t in cast_inputs((ids, x), torch.bfloat16)] == [torch.int64, torch.bfloat16]
    assert [t.dtype for t in upcast((ids, x.bfloat16()), torch.float32)] == [torch.int64, torch.float32]
    precision = Precision(compute="bfloat16", master="float32")
    assert [t.dtype for t in compute_inputs(precision, (ids, x))] == [torch.int64, torch.bfloat16]
    assert compute_inputs(None, (ids, x))[1] is x
    assert torch_dtype("bfloat16") is torch.bfloat16 and dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="not a torch dtype"):
        torch_dtype("Tensor")
