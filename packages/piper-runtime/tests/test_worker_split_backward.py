"""BI/BW instructions on one worker, against single-device autograd.

A one-rank program (no Ray, no communication: ``RankWorker`` is a plain class) runs a chain
s0 -> s1 -> loss over two microbatches. Microbatch 0 uses the split backward (BI now, BW at
the end), microbatch 1 the fused one, so the two share parameter ``.grad`` buffers.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
from torch import nn

from piper_ir import (
    ExecutionError,
    Phase,
    Program,
)
from piper_runtime import OptimizerSpec
from piper_runtime.rank.worker import RankWorker
from piper_runtime.testing import MSE, TanhLinear, compute, one_rank_two_stages

M, BATCH, D_IN, D_HID, D_OUT = 2, 4, 3, 5, 2


def _program(backward: list[tuple[str, Phase, int]]) -> Program:
    forward = [compute(s, Phase.F, i) for i in range(M) for s in ("s0", "s1", "loss")]
    tail = [compute(s, p, i) for s, p, i in backward] + [compute("s0", Phase.OPT), compute("s1", Phase.OPT)]
    return one_rank_two_stages(forward + tail, M, BATCH // M, D_IN, D_HID, D_OUT)


MIXED = [
    ("loss", Phase.B, 0), ("s1", Phase.BI, 0), ("s0", Phase.BI, 0),  # input gradients only
    ("loss", Phase.B, 1), ("s1", Phase.B, 1), ("s0", Phase.B, 1),  # fused, in between
    ("s1", Phase.BW, 0), ("s0", Phase.BW, 0),  # weight gradients last
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def worker():
    w = RankWorker(own_process=False)  # a thread of this process, as the local runtime makes it
    yield w
    w.shutdown()


def _layers(seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    return nn.Linear(D_IN, D_HID), nn.Linear(D_HID, D_OUT)


def _modules(l0: nn.Linear, l1: nn.Linear) -> dict[str, nn.Module]:
    """Copies: the worker runs in this process and must not update the oracle's layers."""
    return {"s0": TanhLinear("l0", copy.deepcopy(l0)), "s1": TanhLinear("l1", copy.deepcopy(l1)), "loss": MSE()}


def _model(l0: nn.Linear, l1: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(l1(torch.tanh(l0(x))))


def test_split_and_fused_backward_match_autograd(worker) -> None:
    l0, l1 = _layers()
    ref = nn.ModuleDict({"l0": l0, "l1": l1})  # the oracle; the worker gets copies of the same weights
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    worker.setup(0, 1, "127.0.0.1", _port(), _program(MIXED), _modules(l0, l1), OptimizerSpec("sgd", lr=0.1))
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, t = torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)
        out = worker.run_step({"input:0": x, "target:0": t}, keep_grads=True)

        with torch.no_grad():
            losses = [nn.functional.mse_loss(_model(l0, l1, xc), tc).item()
                      for xc, tc in zip(x.chunk(M), t.chunk(M), strict=True)]
        ref_opt.zero_grad()
        nn.functional.mse_loss(_model(l0, l1, x), t).backward()
        assert [v for _, v in out.losses] == pytest.approx(losses, rel=1e-6)
        assert set(out.grads) == {n for n, _ in ref.named_parameters()}
        for name, p in ref.named_parameters():
            torch.testing.assert_close(out.grads[name], p.grad, rtol=1e-5, atol=1e-6)
        ref_opt.step()
    params = worker.parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_weight_pass_before_input_pass_is_an_error(worker) -> None:
    bad = [("loss", Phase.B, 0), ("s1", Phase.BW, 0), ("s1", Phase.BI, 0)]
    worker.setup(0, 1, "127.0.0.1", _port(), _program(bad), _modules(*_layers()), OptimizerSpec("sgd", lr=0.1))
    with pytest.raises(ExecutionError, match="weight backward of s1 microbatch 0 before its input backward"):
        worker.run_step({"input:0": torch.randn(BATCH, D_IN), "target:0": torch.randn(BATCH, D_OUT)})
