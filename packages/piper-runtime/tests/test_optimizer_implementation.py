"""Which torch implementation an ``OptimizerSpec`` builds: "auto" fuses Adam and AdamW where
every parameter allows it and leaves SGD to torch's default; the others are torch's keywords.
The fused kernel works element by element, so a ZeRO shard steps exactly like the same
elements of the whole tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from piper_runtime import OptimizerSpec


def _chosen(opt: torch.optim.Optimizer) -> tuple[object, object]:
    group = opt.param_groups[0]
    return group["fused"] or None, group["foreach"]


@pytest.mark.parametrize(
    ("name", "implementation", "expected"),
    [
        ("adamw", "auto", (True, None)),
        ("adam", "auto", (True, None)),
        ("sgd", "auto", (None, None)),
        ("adamw", "fused", (True, None)),
        ("sgd", "fused", (True, None)),
        ("adamw", "foreach", (None, True)),
        ("adamw", "for-loop", (None, False)),
    ],
)
def test_implementation_becomes_torchs_keyword(name: str, implementation: str, expected: tuple) -> None:
    model = nn.Linear(3, 2)
    opt = OptimizerSpec(name, 1e-2, weight_decay=0.1, implementation=implementation).build(model.parameters())
    assert len(opt.param_groups) == 2
    assert all((g["fused"] or None, g["foreach"]) == expected for g in opt.param_groups)


def test_auto_keeps_torchs_default_where_no_fused_kernel_applies() -> None:
    on_meta = nn.Linear(3, 2, device="meta")
    opt = OptimizerSpec("adamw", 1e-2).build(on_meta.parameters())
    assert not opt.param_groups[0]["fused"]


def test_kwargs_choose_torchs_way_with_auto_only() -> None:
    model = nn.Linear(3, 2)
    opt = OptimizerSpec("adamw", 1e-2, kwargs={"foreach": True}).build(model.parameters())
    assert _chosen(opt) == (None, True)
    with pytest.raises(ValueError, match="implementation is given twice"):
        OptimizerSpec("adamw", kwargs={"fused": False}, implementation="fused")
    with pytest.raises(ValueError, match="unknown optimizer implementation 'fast'"):
        OptimizerSpec("adamw", implementation="fast")


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_fused_steps_a_shard_like_the_same_elements_of_the_whole(name: str) -> None:
    torch.manual_seed(0)
    whole = torch.randn(1003)
    cuts = [0, 17, 333, 1003]  # odd lengths: elements fall in the kernel's vector body and its tail
    spec = OptimizerSpec(name, 1e-2, weight_decay=0.1)
    full = nn.Parameter(whole.clone())
    pieces = [nn.Parameter(whole[a:b].clone()) for a, b in zip(cuts, cuts[1:], strict=False)]
    one, many = spec.build([full]), spec.build(pieces)
    assert one.param_groups[0]["fused"] and many.param_groups[0]["fused"]
    for _ in range(4):
        grad = torch.randn(1003)
        full.grad = grad.clone()
        for piece, a, b in zip(pieces, cuts, cuts[1:], strict=False):
            piece.grad = grad[a:b].clone()
        one.step()
        many.step()
    assert torch.equal(full.detach(), torch.cat([p.detach() for p in pieces]))
