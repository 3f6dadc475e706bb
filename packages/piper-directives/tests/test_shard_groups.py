"""Column groups (``shard_groups``, ``shard_heads``): LLaMA-style attention (q/k/v -> attention ->
o, grouped-query key/value heads) and SwiGLU (w1, w3 -> silu(w1 x) * w3 x -> w2), captured by
torch.export (``aten.linear``, head counts baked into views) or torch.fx. Each rank's rewritten
code, run on its shard of the weights with its position, gives a partial block output; the
partials sum to the full block (the row Linears' all-reduce), so the cut is Megatron's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piper_directives import Place, Shard, Strategy, capture, shard_modules
from piper_directives.shard_code import COMM, shard_tensor
from piper_ir import DirectiveError

D, T = 32, 6


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    """Attention with rotary embedding and ``n_kv`` key/value heads, plus SwiGLU; no residual
    (so rank outputs are partial sums of the block's)."""

    def __init__(self, heads: int = 4, n_kv: int = 2, q_norm: bool = False) -> None:
        super().__init__()
        self.heads, self.n_kv, self.hd, self.q_norm = heads, n_kv, D // heads, q_norm
        self.wq = nn.Linear(D, D, bias=False)
        self.wk = nn.Linear(D, n_kv * self.hd, bias=False)
        self.wv = nn.Linear(D, n_kv * self.hd, bias=True)
        self.wo = nn.Linear(D, D, bias=True)
        self.w1, self.w3, self.w2 = nn.Linear(D, 64, bias=False), nn.Linear(D, 64, bias=False), nn.Linear(64, D)
        angles = torch.outer(torch.arange(16).float(), torch.rand(self.hd // 2))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x)
        if self.q_norm:  # normalises over all heads at once: not per head
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
        q = q.view(b, t, self.heads, self.hd)
        k = self.wk(x).view(b, t, self.n_kv, self.hd)
        v = self.wv(x).view(b, t, self.n_kv, self.hd)
        cos, sin = self.cos[:t], self.sin[:t]
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        k = k.repeat_interleave(self.heads // self.n_kv, dim=2)
        v = v.repeat_interleave(self.heads // self.n_kv, dim=2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(att.transpose(1, 2).reshape(b, t, -1)) + self.w2(F.silu(self.w1(x)) * self.w3(x))


class Model(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(**kw)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


class SwiGLU(nn.Module):
    """fx-traceable: nn.Linear calls (``call_module``), no pair (w1 and w3 meet)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"w1": nn.Linear(D, 64), "w3": nn.Linear(D, 64),
                                                    "w2": nn.Linear(64, D)})])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.layers[0]
        return m["w2"](F.silu(m["w1"](x)) * m["w3"](x))


def _shard(model: nn.Module, tp: int, method: str = "export"):
    torch.manual_seed(0)
    x = torch.randn(4, T, D, dtype=torch.float64)
    model = model.double()
    captured = capture(model, (x,), (torch.randn(4, T, D, dtype=torch.float64),), F.mse_loss, method=method)
    devices = tuple(range(tp))
    graph = Strategy([Place({"PP": 0}, devices), Shard({"PP": 0}, devices)]).apply(captured.graph)
    graph, modules = shard_modules(graph, captured.modules)
    return model, x, graph.sharding[0], modules["s0"]


def _rank_sum(module: nn.Module, sh, x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of each rank's output (its shard, its position, collectives unbound:
    the row Linears' partial products, biases added on every rank)."""
    total = 0
    for r in range(sh.degree):
        m = copy.deepcopy(module)
        with torch.no_grad():
            for spec in sh.params:
                p = m.get_parameter(spec.name)
                p.data = shard_tensor(p.data, spec, sh.degree, r)
        m.get_submodule(COMM).position = r
        out = m(x)
        total = total + (out[0] if isinstance(out, tuple) else out)
    return total


def _biases(block: Block) -> torch.Tensor:
    return (sum(b for b in (block.wo.bias, block.w2.bias)) * 1.0).detach()


@pytest.mark.parametrize(("n_kv", "tp", "kv_cut"), [(2, 2, True), (4, 2, True), (1, 2, False), (2, 4, False)])
def test_gqa_attention_and_swiglu_under_export_sum_to_the_full_block(n_kv: int, tp: int, kv_cut: bool) -> None:
    """Query heads split over the group; key/value heads split when the degree divides them,
    else whole on every rank and narrowed to the rank's query heads' ones (MQA: 1 kv head on 2
    ranks; 2 kv heads on 4 ranks: ranks 0, 1 take head 0 and ranks 2, 3 head 1)."""
    model, x, sh, module = _shard(Model(n_kv=n_kv), tp)
    cut = {(p.name, p.dim) for p in sh.params}
    kv = {("layers.0.wk.weight", 0), ("layers.0.wv.weight", 0), ("layers.0.wv.bias", 0)}
    assert cut >= {("layers.0.wq.weight", 0), ("layers.0.wo.weight", 1), ("layers.0.w1.weight", 0),
                   ("layers.0.w3.weight", 0), ("layers.0.w2.weight", 1)}
    assert (kv <= cut) if kv_cut else not (kv & cut)
    assert sh.collectives == 2  # one all-reduce per row Linear
    assert f"view.default(linear, [sym_size_int, sym_size_int_1, {4 // tp}, 8])" in module.code
    block = model.layers[0]
    want = block(x)
    # every rank adds the row Linears' biases after the all-reduce: tp - 1 extra copies in the sum
    torch.testing.assert_close(_rank_sum(module, sh, x) - (tp - 1) * _biases(block), want, rtol=1e-12, atol=1e-12)


def test_swiglu_of_nn_linear_calls_under_fx() -> None:
    model, x, sh, module = _shard(SwiGLU(), 2, method="fx")
    assert {(p.name, p.dim) for p in sh.params} == {
        ("layers.0.w1.weight", 0), ("layers.0.w1.bias", 0), ("layers.0.w3.weight", 0), ("layers.0.w3.bias", 0),
        ("layers.0.w2.weight", 1)}
    want = model(x)
    torch.testing.assert_close(_rank_sum(module, sh, x) - model.layers[0]["w2"].bias.detach(), want)


def test_a_norm_over_all_heads_is_refused_naming_the_line_and_rule() -> None:
    with pytest.raises(DirectiveError) as err:
        _shard(Model(q_norm=True), 2)
    text = str(err.value)
    assert "cannot shard the column group layers.0.wk, layers.0.wq, layers.0.wv -> layers.0.wo" in text
    assert "test_shard_groups.py" in text and "q.pow(2).mean(-1, keepdim=True)" in text
    assert "mean over the cut (heads) axis" in text and "Shard({PP: 0}" in text


def test_a_degree_that_neither_divides_nor_is_a_multiple_of_the_heads_is_refused() -> None:
    with pytest.raises(DirectiveError, match="tensor-parallel degree 3 does not divide") as err:
        _shard(Model(n_kv=2), 3)
    assert "cannot shard the column group" in str(err.value)


class FusedAttention(nn.Module):
    """fx-traceable, as users write GPT attention: a fused q/k/v projection viewed as
    ``(b, t, 3, heads, d_head)`` (a head count in the code), unpacked into q, k, v."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.layers = nn.ModuleList([nn.ModuleDict({"qkv": nn.Linear(D, 3 * D), "proj": nn.Linear(D, D)})])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, (b, t, _) = self.layers[0], x.shape
        q, k, v = m["qkv"](x).view(b, t, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        return m["proj"](y)


def test_fused_qkv_viewed_with_a_head_count_is_cut_within_q_k_and_v() -> None:
    model, x, sh, module = _shard(FusedAttention(), 2, method="fx")
    assert {(p.name, p.dim, p.groups) for p in sh.params} == {
        ("layers.0.qkv.weight", 0, 3), ("layers.0.qkv.bias", 0, 3), ("layers.0.proj.weight", 1, 1)}
    want = model(x)
    torch.testing.assert_close(_rank_sum(module, sh, x) - model.layers[0]["proj"].bias.detach(), want)


ATTENTION_PLAN = {"layers.*.wq": "colwise", "layers.*.wk": "colwise", "layers.*.wv": "colwise", "layers.*.wo": "rowwise"}


def _planned(model: nn.Module, plan: dict, tp: int = 2):
    torch.manual_seed(0)
    x = torch.randn(4, T, D, dtype=torch.float64)
    model = model.double()
    captured = capture(model, (x,), (torch.randn(4, T, D, dtype=torch.float64),), F.mse_loss, method="export")
    devices = tuple(range(tp))
    graph = Strategy([Place({"PP": 0}, devices), Shard({"PP": 0}, devices, plan=plan)]).apply(captured.graph)
    graph, modules = shard_modules(graph, captured.modules)
    return model, x, graph.sharding[0], modules["s0"]


def test_a_plan_by_module_path_cuts_only_the_linears_it_names() -> None:
    """``plan`` names the attention's Linears: the SwiGLU stays whole on every rank."""
    model, x, sh, module = _planned(Model(n_kv=2), ATTENTION_PLAN)
    assert sh.plan == tuple(ATTENTION_PLAN.items())
    assert {p.name for p in sh.params} == {"layers.0.wq.weight", "layers.0.wk.weight", "layers.0.wv.weight",
                                           "layers.0.wv.bias", "layers.0.wo.weight"}
    assert sh.collectives == 1
    block = model.layers[0]
    mlp = block.w2(F.silu(block.w1(x)) * block.w3(x))
    got = _rank_sum(module, sh, x) - block.wo.bias - mlp  # each rank adds the whole MLP and wo's bias
    torch.testing.assert_close(got, block(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("plan", "message"), [
    ({"layers.*.wo": "colwise", "layers.*.w2": "rowwise"},
     "the plan names layers.0.wo colwise, but its output reaches the region's outputs"),
    ({"layers.*.wq": "colwise", "layers.*.wo": "rowwise", "layers.*.w1": "colwise", "layers.*.w3": "colwise"},
     "the plan names layers.0.w1 colwise, but the Linear its output reaches, layers.0.w2, is not named rowwise"),
    ({"layers.*.w1": "colwise", "layers.*.w3": "colwise", "layers.*.w2": "rowwise", "layers.*.wo": "rowwise"},
     "the plan names layers.0.wo rowwise, but no Linear it names colwise reaches it"),
    ({**ATTENTION_PLAN, "layers.*.attention.wq": "colwise"},
     "the plan's pattern 'layers.\\*.attention.wq' names no Linear of the regions it shards"),
])
def test_a_plan_that_cannot_be_followed_is_refused_naming_the_linear(plan: dict, message: str) -> None:
    with pytest.raises(DirectiveError, match=message) as err:
        _planned(Model(n_kv=2), plan)
    assert "plan={" in str(err.value)


def test_plan_styles_are_checked_and_round_trip_through_json() -> None:
    with pytest.raises(DirectiveError, match="plan must map module paths"):
        Shard({"PP": 0}, (0, 1), plan={"layers.*.wq": "column"})
    with pytest.raises(DirectiveError, match="plan must map module paths"):
        Shard({"PP": 0}, (0, 1), kind="ep", plan={"layers.*.wq": "colwise"})
    s = Strategy([Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1), plan=ATTENTION_PLAN)])
    assert Strategy.from_json(s.to_json()) == s
    assert '"layers.*.wo": "rowwise"' in s.to_json()
