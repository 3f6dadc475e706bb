"""``piper_runtime.numerics`` without processes: where a NaN first appeared, and the backup
that undoes a step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from piper_runtime.numerics import StateBackup, first_nonfinite, nonfinite_grad
from piper_runtime.options import check_on_nan


def test_the_first_nonfinite_gradient_is_named() -> None:
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    a.grad, b.grad = torch.ones(2), torch.tensor([1.0, float("inf"), 0.0])
    assert nonfinite_grad([a, b], {id(a): "l0.weight", id(b): "l0.bias"}) == "l0.bias"
    assert nonfinite_grad([b], {}) == "a flat shard of 3 elements"
    assert nonfinite_grad([a], {}) is None and nonfinite_grad([], {}) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_every_nonfinite_element_is_found_wherever_it_sits(dtype: torch.dtype, bad: float) -> None:
    # Lengths and positions around the CPU kernels' vector width: the body and the tail.
    for n in (1, 15, 16, 17, 1001):
        for at in sorted({0, n // 2, n - 1}):
            w = nn.Parameter(torch.zeros(n, dtype=dtype))
            w.grad = torch.randn(n).to(dtype)
            assert nonfinite_grad([w], {id(w): "w"}) is None
            w.grad[at] = bad
            assert nonfinite_grad([w], {id(w): "w"}) == "w", (n, at)


def test_empty_and_huge_gradients_are_finite() -> None:
    empty, huge, half = nn.Parameter(torch.ones(0)), nn.Parameter(torch.ones(2, dtype=torch.float64)), \
        nn.Parameter(torch.ones(2, dtype=torch.float16))
    empty.grad, huge.grad, half.grad = torch.ones(0), torch.tensor([1e300, -1e300], dtype=torch.float64), \
        torch.tensor([65504.0, -65504.0], dtype=torch.float16)  # beyond float32; float16's largest
    assert nonfinite_grad([empty, huge, half], {}) is None
    big = nn.Parameter(torch.ones(2))
    big.grad = torch.tensor([3e38, 3e38])  # each finite, their float32 sum is not
    assert torch.isinf(big.grad.sum()) and nonfinite_grad([big], {}) is None


def test_a_loss_is_named_before_a_gradient_and_the_lowest_microbatch_first() -> None:
    nan, inf = float("nan"), float("inf")
    assert first_nonfinite([(0, (), ()), (1, ((0, 1.0), (1, 2.0)), ())]) is None
    assert first_nonfinite([(0, (), ("segment s0, parameter w",)), (1, ((2, inf), (1, nan)), ())]) == (
        "the loss of microbatch 1 is nan (rank 1)"
    )
    assert first_nonfinite([(1, ((0, 1.0),), ()), (0, (), ("segment s0, parameter w",))]) == (
        "a gradient is not finite on rank 0: segment s0, parameter w (losses were finite)"
    )


def test_the_backup_undoes_an_adam_step_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # some state to keep
    opt.zero_grad()
    backup = StateBackup(list(model.parameters()), [opt])
    backup.save()
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    model(torch.randn(4, 3) * float("nan")).sum().backward()
    opt.step()
    backup.restore()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    restored = opt.state_dict()["state"]
    assert all(torch.equal(restored[k][n], t) for k, v in state.items() for n, t in v.items())
    assert all(p.grad is None for p in model.parameters())


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="on_nan must be one of stop, skip-step, continue"):
        check_on_nan("ignore")
