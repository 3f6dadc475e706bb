"""``piper_runtime.rank.compiled``: one segment's F, B, BI and BW, against autograd on the
module itself (backend ``aot_eager``: the traced aten graphs run as they are)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from piper_runtime.rank.compiled import (
    CompiledSegment,
    CompileError,
    CompileStats,
    WeightProduct,
    signature,
    split_backward,
)


class Block(nn.Module):
    """Two inputs, one without a gradient (token ids), two outputs, one an integer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.emb(ids)
        return self.b(self.drop(torch.tanh(self.a(h)))) + h, ids + 1


def _eager(module: nn.Module, x: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, seed: int):
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out, _ = module(x, ids)
    out.backward(g)
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def _calls(gm: fx.GraphModule) -> int:
    return sum(n.op == "call_function" for n in gm.graph.nodes)


def test_forward_backward_and_the_split_pair_equal_autograd():
    torch.manual_seed(0)
    module = Block()
    x, ids, g = torch.randn(4, 8), torch.randint(0, 10, (4,)), torch.randn(4, 8)
    want_out, want_x, want_w = _eager(module, x, ids, g, seed=7)
    fn = CompiledSegment("s0", module, [x, ids], [True, False], "aot_eager", CompileStats())
    assert fn.takes_grad == [True, False]

    torch.manual_seed(7)  # the same masks as eager's
    (out, plus_one), residuals = fn.forward([x, ids])
    assert torch.equal(out, want_out) and torch.equal(plus_one, ids + 1)
    input_grads, weight_grads = fn.backward(residuals, fn.tangents([g]))
    assert torch.equal(input_grads[0], want_x)
    assert all(torch.equal(a, b) for a, b in zip(weight_grads, want_w, strict=True))

    input_grads, pending = fn.backward_input(residuals, fn.tangents([g]))
    assert torch.equal(input_grads[0], want_x)
    assert all(torch.equal(a, b) for a, b in zip(fn.backward_weight(pending), want_w, strict=True))


def test_split_runs_every_node_of_the_backward_once():
    torch.manual_seed(0)
    module = Block()
    x, ids = torch.randn(4, 8), torch.randint(0, 10, (4,))
    fn = CompiledSegment("s0", module, [x, ids], [True, False], "aot_eager", CompileStats())
    bi, bw, reads = split_backward(fn.bw_graph, fn.input_slots, fn.weight_slots)
    assert _calls(bi) + _calls(bw) == _calls(fn.bw_graph)
    assert _calls(bi) > 0 and _calls(bw) > 0
    # BI returns the input gradient and what BW reads of it: at least the gradient at the
    # Linears' outputs, which the weight gradients need.
    assert len(reads) < len([n for n in fn.bw_graph.graph.nodes if n.op == "placeholder"])


def test_a_missing_output_gradient_counts_as_zero():
    torch.manual_seed(0)
    module = Block()
    x, ids = torch.randn(4, 8), torch.randint(0, 10, (4,))
    fn = CompiledSegment("s0", module, [x, ids], [True, False], "aot_eager", CompileStats())
    _, residuals = fn.forward([x, ids])
    input_grads, weight_grads = fn.backward(residuals, fn.tangents([None]))
    assert not input_grads[0].any() and not any(w.any() for w in weight_grads)


def test_an_in_place_buffer_update_is_refused_naming_the_segment():
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(CompileError, match="segment s3 cannot be compiled.*without --compile"):
        CompiledSegment("s3", module, [torch.randn(5, 4)], [True], "aot_eager", CompileStats())


def test_a_signature_names_shapes_dtypes_and_gradients():
    a, b = torch.randn(2, 3), torch.randn(3, 3)
    assert signature([a], [True]) == signature([a.clone()], [True])
    assert signature([a], [True]) != signature([b], [True])
    assert signature([a], [True]) != signature([a], [False])
    assert signature([a], [True]) != signature([a.double()], [True])


class Wide(nn.Module):
    """Two Linear layers and a bias-free one, on 3-d inputs (a view before each product)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x))) + x


@pytest.mark.parametrize("split", [False, True])
def test_weight_gradients_added_inside_their_products_equal_autograds_sums(split):
    """The fused weights' gradients come back as products (no ``mm`` for them left in the
    graph), and three microbatches added into ``.grad`` through them give autograd's sums up
    to rounding (``addmm_`` instead of ``mm`` then ``add_``); the biases come back whole."""
    torch.manual_seed(0)
    module = Wide()
    fused = [module.up.weight, module.down.weight]
    xs, gs = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4, 8)
    for x, g in zip(xs, gs, strict=True):
        module(x.clone().requires_grad_(True)).backward(g)
    want = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)

    fn = CompiledSegment("s0", module, [xs[0]], [True], "aot_eager", CompileStats(), fused=fused)
    for x, g in zip(xs, gs, strict=True):
        _, residuals = fn.forward([x])
        if split:
            _, pending = fn.backward_input(residuals, fn.tangents([g]))
            weights = fn.backward_weight(pending)
        else:
            _, weights = fn.backward(residuals, fn.tangents([g]))
        products = [isinstance(w, WeightProduct) for w in weights]
        assert products == [isinstance(p, nn.Parameter) and any(p is f for f in fused) for p in fn.params]
        for p, w in zip(fn.params, weights, strict=True):
            if isinstance(w, WeightProduct):
                w.add_into(p)
            else:
                p.grad = w if p.grad is None else p.grad + w
    got = [p.grad for p in module.parameters()]
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(got, want, strict=True))
    assert all(p.grad.stride() == p.stride() for p in module.parameters())
    # Left in the graph: B's two input-gradient products; BW none (they are BI's).
    graph = fn._bw if split else fn._b
    assert sum(n.target is torch.ops.aten.mm.default for n in graph.graph.nodes) == (0 if split else 2)
