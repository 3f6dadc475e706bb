"""``Shard(kind="ep")`` (expert parallelism): IR records, the code rewrite, error messages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from piper_directives import (
    Place,
    Replicate,
    Shard,
    Split,
    Strategy,
    annotate,
    capture,
    expert_parallel,
    one_f_one_b,
    parallelize,
    shard_modules,
)
from piper_directives.expert_code import ExpertParallelComm
from piper_ir import DirectiveError, from_json, to_json


class Experts(nn.Module):
    piper_experts = True

    def __init__(self, num: int, d: int) -> None:
        super().__init__()
        self.num_experts = num
        self.w = nn.Parameter(torch.randn(num, d, d))

    def forward(self, tokens, ids):
        return torch.bmm(tokens.unsqueeze(1), self.w[ids]).squeeze(1)


class MoE(nn.Module):
    def __init__(self, num: int = 4, d: int = 8, blocks: int = 2) -> None:
        super().__init__()
        self.routers = nn.ModuleList(nn.Linear(d, num) for _ in range(blocks))
        self.experts = nn.ModuleList(Experts(num, d) for _ in range(blocks))

    def forward(self, x):
        for router, experts in zip(self.routers, self.experts, strict=True):
            with annotate("PP"):
                gate, ids = router(x).max(dim=-1)
                order = torch.argsort(ids, stable=True)
                y = experts(x[order], ids[order]) * gate[order].unsqueeze(-1)
                x = x + torch.zeros_like(x).index_add(0, order, y)
        return x


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with annotate("PP"):
            return self.lin(x)


def _capture(model: nn.Module):
    torch.manual_seed(0)
    return capture(model, (torch.randn(8, 8),), (torch.randn(8, 8),), nn.functional.mse_loss)


def test_expert_parallel_records_experts_and_keeps_them_out_of_the_buckets() -> None:
    captured = _capture(MoE())
    graph, modules = shard_modules(expert_parallel(one_f_one_b(2, 2), 2).apply(captured.graph), captured.modules)
    assert [(s.segment, s.devices, s.kind, s.degree) for s in graph.sharding] == [
        ("s0", (0, 1), "ep", 2), ("s1", (2, 3), "ep", 2)
    ]
    assert [p.name for p in graph.sharding[0].params] == ["experts.0.w"]
    assert graph.sharding[0].collectives == 1
    # The group is data-parallel for the rest: replicated, batch sharded, router in a bucket.
    assert {r.segment for r in graph.replication} == {"s0", "s1", "loss"}
    assert [b.params for b in graph.buckets] == [("routers.0.weight", "routers.0.bias"), ("routers.1.weight", "routers.1.bias")]
    assert graph.value_by_name["input:0"].meta.shape == (2, 8)  # 8 samples / 2 microbatches / 2 replicas
    assert isinstance(modules["s0"].get_submodule("piper_ep_0"), ExpertParallelComm)
    assert from_json(to_json(graph)) == graph


def test_unbound_rewrite_computes_what_the_original_does() -> None:
    captured = _capture(MoE(blocks=1))
    strategy = Strategy([Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1), kind="ep")])
    _, modules = shard_modules(strategy.apply(captured.graph), captured.modules)
    x = torch.randn(6, 8)
    torch.testing.assert_close(modules["s0"](x)[0], captured.modules["s0"](x)[0], rtol=0, atol=0)


def test_group_must_divide_the_expert_count() -> None:
    captured = _capture(MoE(num=3, blocks=1))
    strategy = Strategy([Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1), kind="ep")])
    with pytest.raises(DirectiveError, match="group of 2 ranks does not divide the 3 experts of experts.0") as err:
        shard_modules(strategy.apply(captured.graph), captured.modules)
    assert "kind='ep'" in str(err.value)


def test_filter_matching_no_region() -> None:
    captured = _capture(MoE(blocks=1))
    shard = Shard({"PP": 4}, (0, 1), kind="ep")
    with pytest.raises(DirectiveError, match=r"filter \{PP: 4\} matches no annotated region") as err:
        Strategy([Place({"PP": 0}, (0, 1)), shard]).apply(captured.graph)
    assert "Shard({PP: 4}" in str(err.value)


def test_region_without_an_expert_module() -> None:
    captured = _capture(Dense())
    strategy = Strategy([Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1), kind="ep")])
    with pytest.raises(DirectiveError, match="calls an expert module"):
        shard_modules(strategy.apply(captured.graph), captured.modules)


def test_shards_of_two_kinds_do_not_mix() -> None:
    captured = _capture(MoE())
    strategy = Strategy([
        Split(2), Place({"PP": 0}, (0, 1)), Place({"PP": 1}, (2, 3)),
        Shard({"PP": 0}, (0, 1), kind="ep"), Shard({"PP": 1}, (2, 3)),
    ])
    with pytest.raises(DirectiveError, match="Shards of different kinds in one strategy .* expert_degree"):
        strategy.apply(captured.graph)


def test_expert_parallel_refuses_sharded_strategies() -> None:
    with pytest.raises(DirectiveError, match="already has a Shard"):
        expert_parallel(expert_parallel(one_f_one_b(2, 2), 2), 2)
    with pytest.raises(DirectiveError, match="ep must be a positive int"):
        expert_parallel(one_f_one_b(2, 2), 0)
    assert expert_parallel(one_f_one_b(2, 2), 1) == one_f_one_b(2, 2)


def test_data_x_expert_parallel_reduces_experts_over_their_holders() -> None:
    """DP=2 x EP=2 x PP=2: stage 0 on (0, 1, 4, 5), experts split over (0, 1) and over
    (4, 5); the router is data-parallel over all four, each expert block over the two ranks
    holding it; the batch is cut among all four."""
    captured = _capture(MoE())
    strategy = expert_parallel(one_f_one_b(2, 2, dp=2, zero=2), 2)
    graph, _ = shard_modules(strategy.apply(captured.graph), captured.modules)
    sh = graph.sharding[0]
    assert (sh.segment, sh.devices, sh.degree, sh.groups()) == ("s0", (0, 1, 4, 5), 2, ((0, 1), (4, 5)))
    assert [(b.id, b.params, b.devices, b.shards, b.numel) for b in graph.buckets if b.segment == "s0"] == [
        ("bucket:s0:0", ("routers.0.weight", "routers.0.bias"), (), 4, 4 * 8 + 4),
        ("bucket:s0:ep0:0", ("experts.0.w",), (0, 4), 2, 2 * 8 * 8),
        ("bucket:s0:ep1:0", ("experts.0.w",), (1, 5), 2, 2 * 8 * 8),
    ]
    assert graph.value_by_name["input:0"].meta.shape == (1, 8)  # 8 samples / 2 microbatches / 4 replicas
    assert from_json(to_json(graph)) == graph


def test_expert_parallel_zero_adds_replicates() -> None:
    strategy = expert_parallel(one_f_one_b(1, 2), 2, zero=1)
    assert [d for d in strategy.directives if isinstance(d, Replicate)] == [Replicate({"PP": 0}, (0, 1), zero=1)]
    with pytest.raises(DirectiveError, match="zero= is for a strategy without Replicate"):
        expert_parallel(one_f_one_b(1, 2, dp=2), 2, zero=1)


def test_tensor_with_expert_parallelism_cuts_the_experts_over_the_wider_group() -> None:
    """tp=2 x ep=2: two tensor-parallel groups, data-parallel replicas of each other, the experts
    split over all four ranks (one each), the router reduced per tensor-parallel position, the
    experts in no bucket (each lives on one rank); with dp=2 each expert is reduced over the two
    ranks holding it."""
    captured = _capture(MoE(blocks=1))
    graph, _ = shard_modules(parallelize(one_f_one_b(1, 2), tp=2, ep=2).apply(captured.graph), captured.modules)
    sh = graph.sharding[0]
    assert (sh.devices, sh.kind, sh.degree, sh.expert_degree) == ((0, 1, 2, 3), "tp", 2, 4)
    assert [(p.name, p.dim, p.experts) for p in sh.params] == [("experts.0.w", 0, True)]
    assert sh.local_meta("experts.0.w", dict(graph.segments[0].params)["experts.0.w"]).shape == (1, 8, 8)
    assert {(b.devices, b.params) for b in graph.buckets if b.segment == "s0"} == {
        ((0, 2), ("routers.0.weight", "routers.0.bias")), ((1, 3), ("routers.0.weight", "routers.0.bias"))
    }
    graph, _ = shard_modules(parallelize(one_f_one_b(1, 2), dp=2, tp=2, ep=2).apply(captured.graph), captured.modules)
    experts = {b.devices for b in graph.buckets if b.segment == "s0" and "experts.0.w" in b.params}
    assert experts == {(0, 4), (1, 5), (2, 6), (3, 7)}


def test_expert_degree_rules() -> None:
    with pytest.raises(DirectiveError, match="expert_degree must be a multiple of the degree"):
        Shard({"PP": 0}, (0, 1, 2, 3), degree=2, expert_degree=3)
    with pytest.raises(DirectiveError, match="expert_degree must be a multiple of the degree"):
        Shard({"PP": 0}, (0, 1, 2, 3), kind="ep", degree=2, expert_degree=4)
    with pytest.raises(DirectiveError, match="sequence parallelism with an expert-parallel group"):
        Shard({"PP": 0}, (0, 1, 2, 3), degree=2, expert_degree=4, sequence_parallel=True)
    shard = Shard({"PP": 0}, (0, 1, 2, 3), degree=2, expert_degree=4)
    assert "expert_degree=4" in str(shard)
    assert Strategy.from_json(Strategy([Place({"PP": 0}, (0, 1, 2, 3)), shard]).to_json()).directives[1] == shard


def test_tensor_with_expert_parallelism_needs_experts_the_group_divides() -> None:
    captured = _capture(MoE(num=6, blocks=1))
    with pytest.raises(DirectiveError, match="expert-parallel group of 4 ranks does not divide the experts of experts.0"):
        shard_modules(parallelize(one_f_one_b(1, 2), tp=2, ep=2).apply(captured.graph), captured.modules)
