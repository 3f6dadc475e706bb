"""Weight gradients summed inside the matrix product (``piper_runtime.rank.accumulation``), against
autograd's own accumulation: the same sums over microbatches, and the layers it must leave
alone left alone."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piper_ir import Phase, Program
from piper_runtime import ExecutionOptions, OptimizerSpec, RankSetup
from piper_runtime.rank.accumulation import accumulate_in_products
from piper_runtime.rank.precision import cast_forward
from piper_runtime.rank.worker import RankWorker
from piper_runtime.testing import MSE, TanhLinear, compute, one_rank_two_stages

M = 4


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3, bias=False))


def _grads_over_microbatches(model: nn.Module, xs: list[torch.Tensor], forward=None) -> dict[str, torch.Tensor]:
    """Each microbatch's forward then backward, gradients accumulating in ``.grad``."""
    forward = forward or model
    for x in xs:
        forward(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _inputs(shape: tuple[int, ...] = (3, 6)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(M)]


@pytest.fixture(autouse=True)
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("shape", [(3, 6), (2, 3, 6), (6,)])
def test_sums_equal_autograds_and_land_in_one_tensor(shape) -> None:
    plain, fused = _mlp(), _mlp()
    assert accumulate_in_products({"s": fused}, [], min_bytes=0) == 3
    want = _grads_over_microbatches(plain, _inputs(shape))
    seen = []
    first = fused[0].weight
    first.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    got = _grads_over_microbatches(fused, _inputs(shape))
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-12)
    # Every pass still ran the weight's gradient hook, after the sum was complete, and the
    # later microbatches were added into the first one's tensor by the product.
    assert len(seen) == M and all(g is first.grad for g in seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch.cuda.is_available() is False here")
def test_sums_on_a_gpu() -> None:
    plain, fused = _mlp().cuda(), _mlp().cuda()
    assert accumulate_in_products({"s": fused}, [], min_bytes=0) == 3
    xs = [x.cuda() for x in _inputs((2, 3, 6))]
    want, got = _grads_over_microbatches(plain, xs), _grads_over_microbatches(fused, xs)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)


def test_a_weight_used_twice_and_tied_to_an_embedding() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.a, self.b = nn.Linear(4, 7, bias=False), nn.Linear(4, 7, bias=False)
            self.b.weight = self.a.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            return self.a(h) + self.b(torch.tanh(h))

    torch.manual_seed(0)
    plain = Tied()
    fused = copy.deepcopy(plain)
    assert accumulate_in_products({"s": fused}, [], min_bytes=0) == 2
    ids = [torch.tensor([[1, 2, 5], [0, 3, 3]]) + k % 2 for k in range(M)]
    want, got = _grads_over_microbatches(plain, ids), _grads_over_microbatches(fused, ids)
    torch.testing.assert_close(got["emb.weight"], want["emb.weight"], rtol=1e-12, atol=1e-12)


def test_cast_copies_and_autocast_take_the_plain_path() -> None:
    # Under ``Program.precision`` the weight a layer sees is a cast copy, not the leaf.
    plain, fused = _mlp(), _mlp()
    accumulate_in_products({"s": fused}, [], min_bytes=0)
    xs = [x.float() for x in _inputs()]
    want = _grads_over_microbatches(plain, xs, lambda x: cast_forward(plain, [x], torch.float32))
    got = _grads_over_microbatches(fused, xs, lambda x: cast_forward(fused, [x], torch.float32))
    for n in want:
        torch.testing.assert_close(got[n], want[n])
        assert got[n].dtype == torch.float64
    fused.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused(torch.randn(2, 6, dtype=torch.float32))
    assert out.dtype == torch.bfloat16 and out.grad_fn.name() != "_LinearAccumulatingBackward"


def test_layers_left_alone() -> None:
    class OwnForward(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    frozen, skipped, own, kept = nn.Linear(2, 2), nn.Linear(2, 2), OwnForward(2, 2), nn.Linear(2, 2)
    split_seg, small = nn.Linear(2, 2), nn.Linear(2, 1)
    frozen.weight.requires_grad_(False)
    instructions = [compute("split", Phase.BI, 0), compute("split", Phase.BW, 0), compute("s", Phase.B, 0)]
    modules = {"s": nn.Sequential(frozen, skipped, own, kept, small), "split": split_seg}
    min_bytes = kept.weight.nbytes  # ``small``'s weight has half as many
    assert accumulate_in_products(modules, instructions, skip={id(skipped.weight)}, min_bytes=min_bytes) == 1
    assert "forward" in vars(kept)
    assert not any("forward" in vars(m) for m in (frozen, skipped, own, split_seg, small))
    x = torch.randn(3, 2, requires_grad=True)
    torch.testing.assert_close(kept(x), F.linear(x, kept.weight, kept.bias))


# One rank (no Ray: ``RankWorker`` is a plain class): s0 runs whole backwards, s1 split ones.
BATCH, D_IN, D_HID, D_OUT = 8, 3, 5, 2


def _program() -> Program:
    plan = [compute(s, Phase.F, i) for i in range(M) for s in ("s0", "s1", "loss")]
    for i in range(M):
        plan += [compute("loss", Phase.B, i), compute("s1", Phase.BI, i), compute("s0", Phase.B, i)]
    plan += [compute("s1", Phase.BW, i) for i in range(M)]
    plan += [compute("s0", Phase.OPT), compute("s1", Phase.OPT)]
    return one_rank_two_stages(plan, M, BATCH // M, D_IN, D_HID, D_OUT)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("fuse", [True, False])
def test_a_worker_fuses_whole_backwards_only_and_matches_autograd(fuse: bool) -> None:
    torch.manual_seed(0)
    l0, l1 = nn.Linear(D_IN, D_HID), nn.Linear(D_HID, D_OUT)
    modules = {"s0": TanhLinear("l0", copy.deepcopy(l0)), "s1": TanhLinear("l1", copy.deepcopy(l1)), "loss": MSE()}
    ref = nn.ModuleDict({"l0": l0, "l1": l1})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    worker = RankWorker(own_process=False)  # a thread of this process, as the local runtime makes it
    try:
        execution = ExecutionOptions(grad_fusion_min_bytes=0 if fuse else None)
        worker.setup(0, 1, "127.0.0.1", _port(), _program(), modules, OptimizerSpec("sgd", lr=0.1), "cpu",
                     RankSetup(execution))
        assert ("forward" in vars(worker._modules["s0"].l0)) is fuse and worker.fused_layers == int(fuse)
        assert "forward" not in vars(worker._modules["s1"].l1)
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, t = torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)
            out = worker.run_step({"input:0": x, "target:0": t}, keep_grads=True)
            ref_opt.zero_grad()
            F.mse_loss(torch.tanh(l1(torch.tanh(l0(x)))), t).backward()
            for name, p in ref.named_parameters():
                torch.testing.assert_close(out.grads[name], p.grad, rtol=1e-12, atol=1e-12)
            ref_opt.step()
    finally:
        worker.shutdown()
