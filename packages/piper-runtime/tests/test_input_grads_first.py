"""A backward's input gradient sent before its weight products (``piper_runtime.rank.input_grads_first``):
the windows found in a rank's plan, and deferred products that sum bit for bit as undeferred.
Two ranks on Ray: ``integration/test_grad_fusion.py``."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

from piper_ir import Instruction, NodeKind, Phase
from piper_runtime.rank.accumulation import (
    WeightProducts,
    accumulate_in_products,
    deferring,
    fused_weights,
    has_fused_layers,
)
from piper_runtime.rank.input_grads_first import deferral_windows
from piper_runtime.rank.streams import StreamLayout
from piper_runtime.testing import compute, with_stream_events

M = 4


def send(value: str, mb: int, stream: str = "compute") -> Instruction:
    return Instruction(id=f"send:{value}:{mb}", kind=NodeKind.SEND, value=value, microbatch=mb, peer=0,
                       communicator="pp.bwd", stream=stream)


def recv(value: str, mb: int, stream: str = "compute") -> Instruction:
    return Instruction(id=f"recv:{value}:{mb}", kind=NodeKind.RECV, value=value, microbatch=mb, peer=0,
                       communicator="pp.fwd", stream=stream)


def last_stage(microbatches: int = 2) -> list[Instruction]:
    """Rank 1 of 1F1B at pp=2: each loss ``B`` runs its stage's pass, then the gradient's send."""
    out: list[Instruction] = []
    for i in range(microbatches):
        out += [recv("h", i), compute("s1", Phase.F, i), compute("loss", Phase.F, i)]
        out += [compute("loss", Phase.B, i), compute("s1", Phase.B, i), send("grad:h", i)]
    return out + [compute("s1", Phase.OPT)]


def _fused_loss(first: Instruction, other: Instruction) -> bool:
    return first.segment == "loss" and other.segment == "s1" and other.microbatch == first.microbatch


def test_the_last_backward_and_the_send_after_it_make_the_window() -> None:
    plan = last_stage()
    windows = deferral_windows(plan, lambda ins: True, _fused_loss, None)
    # The send (index 11) closes the window of the last loss B and its stage's (9-10); the
    # first microbatch's backward (3-4, its send at 5) is not the drain's.
    assert windows == {11: (9, 10)}
    # Without the loss fused, the stage's own B opens it.
    assert deferral_windows(plan, lambda ins: ins.segment == "s1", lambda a, b: False, None) == {11: (10,)}


def test_what_makes_no_window() -> None:
    plan = last_stage()
    assert deferral_windows(plan, lambda ins: False, _fused_loss, None) == {}  # nothing to defer
    no_send = [ins for ins in plan if ins.kind is not NodeKind.SEND]
    assert deferral_windows(no_send, lambda ins: True, _fused_loss, None) == {}  # the first stage's
    paired = [attrs.evolve(ins, overlap=0) if ins.kind is NodeKind.COMPUTE else ins for ins in plan]
    assert deferral_windows(paired, lambda ins: True, _fused_loss, None) == {}  # DualPipe's slots
    # Something between the backward and the send ends the window without a send in it.
    between = [*plan[:11], compute("s1", Phase.F, 2), *plan[11:]]
    assert deferral_windows(between, lambda ins: True, _fused_loss, None) == {}
    # Another segment's B is not part of the window: the loss's pass is not its stage's.
    apart = [*plan[:10], compute("s0", Phase.B, 1), *plan[10:]]
    assert deferral_windows(apart, lambda ins: True, _fused_loss, None) == {12: (11,)}


def test_a_backward_another_thread_waits_for_has_no_window() -> None:
    """A data-parallel reduction on a lane of its own waits for the last backward's event:
    it would read the gradient before the deferred products are in it."""
    plan = last_stage()
    reduce = Instruction(id="ar:0", kind=NodeKind.ALL_REDUCE, value="bucket:0", communicator="dp", stream="dp")
    events = with_stream_events([*plan[:-1], reduce, plan[-1]])
    events[-2] = attrs.evolve(events[-2], waits=(*events[-2].waits, "ev:b"))
    events[10] = attrs.evolve(events[10], record="ev:b")  # the last stage B
    layout = StreamLayout(events)
    assert "ev:b" in layout.events
    assert deferral_windows(events, lambda ins: True, _fused_loss, layout) == {}
    assert deferral_windows(events, lambda ins: True, _fused_loss, None) == {11: (9, 10)}  # one thread


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3, bias=False))


class _Residual(nn.Module):
    """Two residual blocks: the gradient a block's second layer receives is also the one
    autograd sums the skip path's into (in place, when nothing else holds it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 6)) for _ in range(2))
        self.head = nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("make", [_model, _Residual], ids=["chain", "residual"])
def test_deferred_products_sum_bit_for_bit_as_undeferred(make) -> None:
    """float32 (rounding shows), several microbatches: each pass's input gradient comes out
    before its weight products are in ``.grad``, and the sums end up identical."""
    plain, deferred = make(), make()
    layers = sum(isinstance(m, nn.Linear) for m in plain.modules())
    assert accumulate_in_products({"s": plain}, [], min_bytes=0) == layers
    assert accumulate_in_products({"s": deferred}, [], min_bytes=0) == layers
    assert has_fused_layers(deferred) and not has_fused_layers(make())
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(7, 6, generator=g) for _ in range(M)]
    products = WeightProducts()
    for x in xs:
        plain(x.clone().requires_grad_()).square().sum().backward()
        xd = x.clone().requires_grad_()
        before = {n: None if p.grad is None else p.grad.clone() for n, p in deferred.named_parameters()}
        with deferring(products, fused_weights({"s": deferred})):
            deferred(xd).square().sum().backward()
        assert xd.grad is not None and len(products.pending) == layers
        for n, p in deferred.named_parameters():  # weights wait, biases do not
            unchanged = (p.grad is None) if before[n] is None else torch.equal(p.grad, before[n])
            assert unchanged is n.endswith("weight"), n
        products.settle()
        assert not products
    for (n, a), b in zip(plain.named_parameters(), deferred.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), n


def test_outside_deferring_nothing_waits() -> None:
    model = _model()
    accumulate_in_products({"s": model}, [], min_bytes=0)
    products = WeightProducts()
    with deferring(products, fused_weights({"s": model})):
        pass
    model(torch.randn(2, 6)).sum().backward()
    assert not products and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float64])
def test_settle_adds_into_an_existing_sum_in_place(dtype: torch.dtype) -> None:
    layer = nn.Linear(3, 2).to(dtype)
    accumulate_in_products({"s": layer}, [], min_bytes=0)
    layer.weight.grad = torch.ones_like(layer.weight)
    held = layer.weight.grad
    products = WeightProducts()
    x = torch.randn(4, 3, dtype=dtype)
    with deferring(products, fused_weights({"s": layer})):
        layer(x).sum().backward()
    products.settle()
    assert layer.weight.grad is held
    torch.testing.assert_close(held, 1 + torch.ones(4, 2, dtype=dtype).t() @ x)


def test_a_window_defers_only_its_own_ranks_products() -> None:
    """Two ranks as threads of one process (the CUDA fakes, a local runtime): while one rank
    defers its products, another rank's backward adds its own into ``.grad`` as usual."""
    mine, other = _model(), _model(seed=1)
    for model in (mine, other):
        accumulate_in_products({"s": model}, [], min_bytes=0)
    products = WeightProducts()
    x = torch.randn(7, 6)
    with deferring(products, fused_weights({"s": mine})):
        other(x).square().sum().backward()  # the other rank's pass, meanwhile
        mine(x).square().sum().backward()
    assert all(p.grad is not None for p in other.parameters())
    assert {id(w) for w, _, _ in products.pending} == {id(w) for w in fused_weights({"s": mine})}
