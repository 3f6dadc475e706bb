"""``Shard`` (tensor parallelism): the IR records, the code rewrite, and every error message."""

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
    one_f_one_b,
    shard_modules,
    tensor_parallel,
)
from piper_ir import DirectiveError, ParamShard, from_json, to_json


class Block(nn.Module):
    """Attention (fused qkv, heads on a ``-1`` axis) and an MLP, one region per block."""

    def __init__(self, d: int = 16, heads: int = 4, hidden: int = 32, qkv_shape=None) -> None:
        super().__init__()
        self.d_head = d // heads
        self.qkv_shape = qkv_shape or (3, -1, self.d_head)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, self.qkv_shape).permute(2, 0, 3, 1, 4).unbind(0)
        att = ((q @ k.transpose(-2, -1)) * 0.5).softmax(dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).flatten(2))
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Model(nn.Module):
    def __init__(self, blocks: int = 2, **kw) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(**kw) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            with annotate("PP"):
                x = b(x)
        return x


class OneLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        with annotate("PP"):
            return self.lin(x)


def _capture(model: nn.Module):
    torch.manual_seed(0)
    x = torch.randn(4, 5, 16)
    return capture(model, (x,), (torch.randn(4, 5, 16),), nn.functional.mse_loss)


def _tp(blocks: int, tp: int) -> Strategy:
    return tensor_parallel(one_f_one_b(blocks, 2), tp)


def test_tensor_parallel_places_groups_and_records_sharding() -> None:
    captured = _capture(Model())
    graph, modules = shard_modules(_tp(2, 2).apply(captured.graph), captured.modules)
    by_seg = {sh.segment: sh for sh in graph.sharding}
    assert set(by_seg) == {"s0", "s1", "loss"}
    assert by_seg["s0"].devices == (0, 1) and by_seg["s1"].devices == (2, 3) and by_seg["loss"].devices == (2, 3)
    assert by_seg["s0"].params == (
        ParamShard("blocks.0.qkv.weight", 0, 3),
        ParamShard("blocks.0.proj.weight", 1, 1),
        ParamShard("blocks.0.fc1.weight", 0, 1),
        ParamShard("blocks.0.fc1.bias", 0, 1),
        ParamShard("blocks.0.fc2.weight", 1, 1),
    )
    assert (by_seg["s0"].collectives, by_seg["loss"].collectives) == (2, 0)
    assert graph.replication == () and graph.buckets == ()
    assert "piper_tp" in dict(modules["s0"].named_modules())
    assert modules["s0"] is not captured.modules["s0"]  # the captured modules are left alone
    assert from_json(to_json(graph)) == graph


def test_param_shard_pieces_cut_each_group() -> None:
    spec = ParamShard("w", 0, 3)
    assert spec.pieces(12, 2, 0) == ((0, 2), (4, 2), (8, 2))
    assert spec.pieces(12, 2, 1) == ((2, 2), (6, 2), (10, 2))
    with pytest.raises(ValueError, match="do not cut"):
        spec.pieces(12, 5, 0)


def test_rank_shards_of_a_column_row_pair_sum_to_the_full_attention() -> None:
    """The recorded cuts are Megatron's: with each rank's shard of qkv (q, k and v cut
    separately) and of the output projection, the ranks' partial products sum to the full
    attention output."""
    from piper_directives.shard_code import shard_tensor

    captured = _capture(Model(blocks=1))
    graph, modules = shard_modules(
        Strategy([Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1))]).apply(captured.graph), captured.modules
    )
    sh = graph.sharding[0]
    x = torch.randn(2, 5, 16)
    block = captured.modules["s0"].get_submodule("blocks.0")
    # Per-rank partial outputs of the attention projection, summed, equal the full one.
    att_in = block.qkv(x).unflatten(-1, (3, -1, 4)).permute(2, 0, 3, 1, 4).unbind(0)
    q, k, v = att_in
    want = block.proj((((q @ k.transpose(-2, -1)) * 0.5).softmax(-1) @ v).transpose(1, 2).flatten(2))
    got = 0
    for r in range(2):
        w = {s.name: shard_tensor(block.get_parameter(s.name.removeprefix("blocks.0.")).detach(), s, 2, r)
             for s in sh.params}
        qr, kr, vr = (x @ w["blocks.0.qkv.weight"].T).unflatten(-1, (3, -1, 4)).permute(2, 0, 3, 1, 4).unbind(0)
        a = (((qr @ kr.transpose(-2, -1)) * 0.5).softmax(-1) @ vr).transpose(1, 2).flatten(2)
        got = got + a @ w["blocks.0.proj.weight"].T
    torch.testing.assert_close(got + block.proj.bias, want)


def test_json_round_trip() -> None:
    s = Strategy([Split(2), Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1))])
    again = Strategy.from_json(s.to_json())
    assert again == s
    assert '"op": "shard"' in s.to_json()


def test_filter_matching_no_region() -> None:
    captured = _capture(Model(blocks=1))
    shard = Shard({"PP": 5}, (0, 1))
    with pytest.raises(DirectiveError, match=r"filter \{PP: 5\} matches no annotated region") as err:
        Strategy([Place({"PP": 0}, (0, 1)), shard]).apply(captured.graph)
    assert "Shard({PP: 5}" in str(err.value)


@pytest.mark.parametrize(("tp", "message"), [(3, "does not divide the 4 heads of blocks.0.qkv")])
def test_tp_degree_must_divide_heads(tp: int, message: str) -> None:
    captured = _capture(Model(blocks=1))
    devices = tuple(range(tp))
    graph = Strategy([Place({"PP": 0}, devices), Shard({"PP": 0}, devices)]).apply(captured.graph)
    with pytest.raises(DirectiveError, match=message) as err:
        shard_modules(graph, captured.modules)
    assert "Shard({PP: 0}" in str(err.value)


def test_tp_degree_must_divide_hidden_size() -> None:
    captured = _capture(Model(blocks=1, d=16, heads=4, hidden=18))  # heads 4 % 2 == 0, hidden 18 % 4 != 0
    devices = tuple(range(4))
    graph = Strategy([Place({"PP": 0}, devices), Shard({"PP": 0}, devices)]).apply(captured.graph)
    with pytest.raises(DirectiveError, match="does not divide the hidden size 18 of blocks.0.fc1"):
        shard_modules(graph, captured.modules)


def test_hard_coded_head_count_is_refused() -> None:
    captured = _capture(Model(blocks=1, qkv_shape=(3, 4, 4)))
    graph = Strategy([Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1))]).apply(captured.graph)
    with pytest.raises(DirectiveError, match=r"reshape it only with unflatten\(-1, \(\.\.\., -1, d_head\)\)"):
        shard_modules(graph, captured.modules)


def test_region_without_a_linear_pair() -> None:
    captured = _capture(OneLinear())
    graph = Strategy([Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1))]).apply(captured.graph)
    with pytest.raises(DirectiveError, match="holds a column-/row-parallel Linear pair"):
        shard_modules(graph, captured.modules)


def test_devices_must_equal_the_placement_group() -> None:
    captured = _capture(Model(blocks=1))
    with pytest.raises(DirectiveError, match="the devices must be the placement group"):
        Strategy([Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (1, 0))]).apply(captured.graph)


def test_unsharded_group_next_to_a_sharded_one() -> None:
    captured = _capture(Model(blocks=2))
    strategy = Strategy([Place({"PP": 0}, (0, 1)), Place({"PP": 1}, (2, 3)), Shard({"PP": 0}, (0, 1))])
    with pytest.raises(DirectiveError, match="without a Shard while other groups are tensor-parallel"):
        strategy.apply(captured.graph)


def test_replicate_on_a_tensor_parallel_group_without_replicas() -> None:
    captured = _capture(Model(blocks=1))
    strategy = Strategy([Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1)), Replicate({"PP": 0}, (0, 1))])
    with pytest.raises(DirectiveError, match="tensor-parallel group that has no data-parallel replicas"):
        strategy.apply(captured.graph)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"devices": (0,)}, "at least two devices"),
        ({"devices": (0, 1), "kind": "xp"}, "kind must be one of"),
        ({"devices": (0, 1, 2, 3), "degree": 3}, "degree must be an int >= 2 that divides the 4 devices"),
        ({"devices": (0, 1, 2, 3), "degree": 1}, "degree must be an int >= 2"),
    ],
)
def test_bad_shard_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(DirectiveError, match=message):
        Shard({"PP": 0}, **kwargs)


def test_tensor_parallel_refuses_sharded_strategies() -> None:
    with pytest.raises(DirectiveError, match="already has a Shard"):
        tensor_parallel(tensor_parallel(one_f_one_b(2, 2), 2), 2)
    with pytest.raises(DirectiveError, match="tp must be a positive int"):
        tensor_parallel(one_f_one_b(2, 2), 0)
    assert tensor_parallel(one_f_one_b(2, 2), 1) == one_f_one_b(2, 2)


def test_data_x_tensor_parallel_records_holders_buckets_and_batch_shards() -> None:
    """DP=2 x TP=2 x PP=2: ``tensor_parallel`` over a data-parallel 1F1B. Stage 0's group is
    (0, 1, 4, 5): TP groups (0, 1) and (4, 5), replicas of each other; ranks 0 and 4 hold
    shard 0 and reduce it, 1 and 5 shard 1. Every bucket is one position's, with the shard's
    sizes; the batch is cut among the two replicas only."""
    captured = _capture(Model())
    strategy = tensor_parallel(one_f_one_b(2, 2, dp=2, zero=1), 2)
    graph, _ = shard_modules(strategy.apply(captured.graph), captured.modules)
    by_seg = {sh.segment: sh for sh in graph.sharding}
    s0 = by_seg["s0"]
    assert (s0.devices, s0.degree) == ((0, 1, 4, 5), 2)
    assert s0.groups() == ((0, 1), (4, 5)) and (s0.holders(0), s0.holders(1)) == ((0, 4), (1, 5))
    assert {(r.segment, r.devices, r.zero) for r in graph.replication} == {
        ("s0", (0, 1, 4, 5), 1), ("s1", (2, 3, 6, 7), 1), ("loss", (2, 3, 6, 7), 0)
    }
    full = sum(m.numel() for _, m in graph.segment_by_id["s0"].params)
    cut = sum(m.numel() for n, m in graph.segment_by_id["s0"].params if n in {p.name for p in s0.params})
    s0_buckets = [b for b in graph.buckets if b.segment == "s0"]
    assert [(b.id, b.devices, b.shards) for b in s0_buckets] == [
        ("bucket:s0:tp0:0", (0, 4), 2), ("bucket:s0:tp1:0", (1, 5), 2)
    ]
    assert all(b.numel == full - cut // 2 for b in s0_buckets)
    assert graph.value_by_name["input:0"].meta.shape == (1, 5, 16)  # 4 samples / 2 microbatches / 2 replicas
    assert from_json(to_json(graph)) == graph
    assert Strategy.from_json(strategy.to_json()) == strategy
    assert '"degree": 2' in strategy.to_json()


def test_data_x_tensor_parallel_compiles_to_per_group_communicators() -> None:
    from piper_memory import plan_memory
    from piper_scheduler import compile_program

    captured = _capture(Model(blocks=1))
    graph, _ = shard_modules(tensor_parallel(one_f_one_b(1, 2, dp=2, zero=3), 2).apply(captured.graph), captured.modules)
    program = compile_program(plan_memory(graph))
    assert (program.replicas, [p.replica for p in program.ranks]) == (2, [0, 0, 1, 1])
    assert {c.id for c in program.communicators} == {"tp:0-1", "tp:2-3", "dp:0-2", "dp:1-3"}
    for plan in program.ranks:
        comms = {i.communicator for i in plan.instructions if i.communicator}
        assert comms == {f"tp:{'0-1' if plan.rank < 2 else '2-3'}", f"dp:{'0-2' if plan.rank % 2 == 0 else '1-3'}"}


def test_shards_of_different_degrees_are_refused() -> None:
    captured = _capture(Model())
    strategy = Strategy([
        Place({"PP": 0}, (0, 1, 2, 3)), Place({"PP": 1}, (4, 5, 6, 7)),
        Shard({"PP": 0}, (0, 1, 2, 3), degree=2), Shard({"PP": 1}, (4, 5, 6, 7)),
    ])
    with pytest.raises(DirectiveError, match=r"Shards of different degrees \[2, 4\]"):
        strategy.apply(captured.graph)
