"""Replicate and data_parallel: placement groups, Replication records, buckets, batch shards,
elementwise send/receive pairing, JSON form, and one negative test per message."""

from __future__ import annotations

import json

import pytest

from piper_directives import (
    Order,
    Place,
    Replicate,
    Split,
    Strategy,
    build_schedule,
    data_parallel,
    one_f_one_b,
)
from piper_directives.replicate import make_buckets
from piper_directives.synthetic import synthetic_graph
from piper_ir import DirectiveError, EdgeKind, NodeKind, Replication, Segment, SegmentRole, Tags, TensorMeta

HIDDEN = 8
PARAM_BYTES = (HIDDEN * HIDDEN + HIDDEN) * 4  # weight + bias of one synthetic segment


def _graph(stages: int = 2, microbatches: int = 4, batch: int = 2):
    return synthetic_graph(stages, microbatches, hidden=HIDDEN, batch=batch)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_1f1b_places_groups_and_records_replication(zero: int) -> None:
    strategy = build_schedule("1f1b", 2, 4, dp=2, zero=zero)
    places = [d for d in strategy.directives if isinstance(d, Place)]
    assert [p.devices for p in places] == [(0, 2), (1, 3)]  # rank r, replica j -> r + j * pp
    graph = strategy.apply(_graph())
    assert graph.world_size == 4
    assert {r.segment: (r.devices, r.zero) for r in graph.replication} == {
        "s0": ((0, 2), zero),
        "s1": ((1, 3), zero),
        "loss": ((1, 3), 0),  # placed with the last stage, no Replicate names it: the default
    }
    shards = 2 if zero else 1
    assert [(b.id, b.params, b.numel, b.shards) for b in graph.buckets] == [
        ("bucket:s0:0", ("layers.0.weight", "layers.0.bias"), HIDDEN * HIDDEN + HIDDEN, shards),
        ("bucket:s1:0", ("layers.1.weight", "layers.1.bias"), HIDDEN * HIDDEN + HIDDEN, shards),
    ]
    # One shard of one microbatch: 16 rows / 4 microbatches / 2 replicas.
    assert graph.value_by_name["v:s0"].meta.shape == (1 * 2 // 2, HIDDEN)
    assert graph.value_by_name["grad:v:s0"].meta.shape == (1, HIDDEN)


def test_sends_pair_groups_elementwise_and_orders_cover_every_replica() -> None:
    graph = build_schedule("1f1b", 2, 2, dp=2).apply(_graph(microbatches=2))
    send = graph.node("send.v:s0.mb0.0_2-1_3")
    recv = graph.node("recv.v:s0.mb0.0_2-1_3")
    assert (send.devices, send.peers) == ((0, 2), (1, 3))
    assert (recv.devices, recv.peers) == ((1, 3), (0, 2))
    back = graph.node("send.grad:v:s0.mb1.1_3-0_2")
    assert (back.devices, back.peers) == ((1, 3), (0, 2))
    temporal = [e for e in graph.edges if e.kind is EdgeKind.TEMPORAL]
    assert temporal and all(graph.node(e.src).devices == graph.node(e.dst).devices for e in temporal)


def test_every_schedule_composes_with_data_parallelism() -> None:
    for name, stages, mb in [("gpipe", 2, 2), ("zb1p", 2, 2), ("interleaved_1f1b", 4, 2), ("dualpipev", 4, 4)]:
        graph = build_schedule(name, 2, mb, stages=stages, dp=2, zero=1).apply(_graph(stages, mb))
        assert graph.world_size == 4
        assert {len(r.devices) for r in graph.replication} == {2}
        assert len(graph.buckets) == stages


def test_multi_device_place_without_replicate_gets_zero_0() -> None:
    graph = Strategy([Split(2), Place({"PP": 0}, (0, 1))]).apply(_graph(stages=1, microbatches=2))
    assert graph.replication == (
        Replication("s0", (0, 1)),
        Replication("loss", (0, 1)),
    )
    assert [b.shards for b in graph.buckets] == [1]


def test_single_device_strategies_are_unchanged() -> None:
    plain = one_f_one_b(2, 4)
    assert data_parallel(plain, 1) is plain
    graph = plain.apply(_graph())
    assert graph.replication == () and graph.buckets == ()
    assert graph.value_by_name["v:s0"].meta.shape == (2, HIDDEN)


def test_buckets_are_cut_by_size_in_parameter_order() -> None:
    f32 = "float32"
    seg = Segment(
        "s0",
        SegmentRole.STAGE,
        Tags(),
        (),
        (),
        (
            ("a", TensorMeta((10,), f32)),  # 40 bytes
            ("b", TensorMeta((10,), f32)),  # 40
            ("c", TensorMeta((100,), f32)),  # 400: larger than the cap, a bucket alone
            ("d", TensorMeta((5,), "float64")),  # 40, another dtype: a new bucket
            ("e", TensorMeta((5,), "float64")),
        ),
    )
    buckets = make_buckets(seg, 100, 3)
    assert [(b.id, b.params, b.numel, b.dtype) for b in buckets] == [
        ("bucket:s0:0", ("a", "b"), 20, f32),
        ("bucket:s0:1", ("c",), 100, f32),
        ("bucket:s0:2", ("d", "e"), 10, "float64"),
    ]
    assert (buckets[0].shard_numel, buckets[0].padded_numel) == (7, 21)


def test_bucket_mb_reaches_the_buckets() -> None:
    strategy = one_f_one_b(2, 2)
    tiny = PARAM_BYTES / 2 / 2**20  # the weight (256 bytes) fits, weight + bias does not
    strategy = Strategy(
        [*data_parallel(strategy, 2).directives[:-2], *(Replicate({"PP": r}, (r, r + 2), 2, tiny) for r in range(2))]
    )
    graph = strategy.apply(_graph(microbatches=2))
    assert [b.params for b in graph.buckets if b.segment == "s0"] == [("layers.0.weight",), ("layers.0.bias",)]
    assert graph.replication[0].bucket_bytes == int(tiny * 2**20)


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [4, -1, True, 1.0, "2"])
def test_zero_out_of_range(zero: object) -> None:
    with pytest.raises(DirectiveError, match="zero must be one of 0, 1, 2, 3") as err:
        Replicate({"PP": 0}, (0, 1), zero=zero)  # type: ignore[arg-type]
    assert "test_replicate.py" in str(err.value)  # the directive, with where it was written


@pytest.mark.parametrize("bucket_mb", [0, -1.5, float("nan"), float("inf"), True, "25"])
def test_bucket_size_must_be_positive(bucket_mb: object) -> None:
    with pytest.raises(DirectiveError, match="bucket_mb must be a positive number"):
        Replicate({"PP": 0}, (0, 1), bucket_mb=bucket_mb)  # type: ignore[arg-type]


def test_stream_must_not_be_compute() -> None:
    with pytest.raises(DirectiveError, match="reduce_stream must name a stream other than 'compute'"):
        Replicate({"PP": 0}, (0, 1), reduce_stream="compute")


def _dp_strategy(*replicates: Replicate) -> Strategy:
    return Strategy([Split(2), Place({"PP": 0}, (0, 2)), Place({"PP": 1}, (1, 3)), *replicates])


def test_devices_must_equal_the_placement_group() -> None:
    with pytest.raises(DirectiveError, match=r"placed on \[0, 2\], but Replicate names \[0, 1\]") as err:
        _dp_strategy(Replicate({"PP": 0}, (0, 1))).apply(_graph(microbatches=2))
    assert "Replicate({PP: 0}" in str(err.value)
    with pytest.raises(DirectiveError, match=r"placed on \[0, 2\], but Replicate names \[2, 0\]"):
        _dp_strategy(Replicate({"PP": 0}, (2, 0))).apply(_graph(microbatches=2))


def test_filter_must_match_a_region() -> None:
    with pytest.raises(DirectiveError, match=r"filter \{PP: 7\} matches no annotated region"):
        _dp_strategy(Replicate({"PP": 7}, (0, 2))).apply(_graph(microbatches=2))


def test_replicate_needs_two_devices() -> None:
    strategy = Strategy([Split(2), Place({"PP": 0}, 0), Place({"PP": 1}, 1), Replicate({"PP": 0}, 0)])
    with pytest.raises(DirectiveError, match="at least two devices"):
        strategy.apply(_graph(microbatches=2))


def test_replicated_twice_with_different_settings() -> None:
    strategy = _dp_strategy(Replicate({"PP": 0}, (0, 2), zero=1), Replicate({"PP": "*"}, (0, 2), zero=2))
    with pytest.raises(DirectiveError, match="replicated twice with different settings"):
        strategy.apply(_graph(microbatches=2))


def test_groups_of_different_sizes() -> None:
    strategy = Strategy([Split(2), Place({"PP": 0}, (0, 1)), Place({"PP": 1}, (2, 3, 4))])
    with pytest.raises(DirectiveError, match=r"device groups of different sizes \[2, 3\]") as err:
        strategy.apply(_graph(microbatches=2))
    assert "Place({PP: 1}, devices=[2, 3, 4]" in str(err.value)
    mixed = Strategy([Split(2), Place({"PP": 0}, (0, 1)), Place({"PP": 1}, 2)])
    with pytest.raises(DirectiveError, match="both groups need the same number of devices"):
        mixed.apply(_graph(microbatches=2))


def test_paired_replicas_must_differ() -> None:
    strategy = Strategy([Split(2), Place({"PP": 0}, (0, 1)), Place({"PP": 1}, (0, 2))])
    with pytest.raises(DirectiveError, match="device 0 would send to itself"):
        strategy.apply(_graph(microbatches=2))


def test_batch_must_divide_among_replicas() -> None:
    with pytest.raises(DirectiveError, match="not divisible among 2 data-parallel replicas"):
        build_schedule("gpipe", 2, 2, dp=2).apply(_graph(microbatches=2, batch=1))


def test_data_parallel_errors() -> None:
    with pytest.raises(DirectiveError, match="dp must be a positive int"):
        build_schedule("1f1b", 2, 2, dp=0)
    with pytest.raises(DirectiveError, match="ZeRO-2 shards over data-parallel replicas; it needs dp >= 2"):
        build_schedule("1f1b", 2, 2, zero=2)
    with pytest.raises(DirectiveError, match="zero must be one of"):
        build_schedule("gpipe", 2, 2, dp=2, zero=5)
    with pytest.raises(DirectiveError, match="already replicated"):
        data_parallel(data_parallel(one_f_one_b(2, 2), 2), 2)


# --- JSON -----------------------------------------------------------------------------------


def test_json_round_trip_and_same_graph() -> None:
    strategy = build_schedule("zb1p", 2, 2, dp=2, zero=3)
    text = strategy.to_json()
    doc = json.loads(text)
    assert {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 2], "zero": 3, "bucket_mb": 25.0,
            "reduce_stream": "dp", "gather_stream": "dp"} in doc["directives"]
    again = Strategy.from_json(text)
    assert again == strategy
    graphs = [s.apply(_graph(microbatches=2)) for s in (again, strategy)]  # origins differ: where
    assert len({tuple((n.id, n.devices, n.peers) for n in g.nodes) for g in graphs}) == 1
    assert len({tuple((e.src, e.dst, e.kind) for e in g.edges) for g in graphs}) == 1
    assert len({(g.buckets, tuple(r.zero for r in g.replication)) for g in graphs}) == 1


def test_json_minimal_replicate() -> None:
    doc = {"directives": [
        {"op": "split", "microbatches": 2},
        {"op": "place", "filter": {"PP": 0}, "devices": [0, 2]},
        {"op": "place", "filter": {"PP": 1}, "devices": [1, 3]},
        {"op": "replicate", "filter": {"PP": "*"}, "devices": [0, 2], "zero": 2, "bucket_mb": 25},
    ]}
    strategy = Strategy.from_json(json.dumps(doc))
    rep = strategy.directives[-1]
    assert isinstance(rep, Replicate) and (rep.zero, rep.bucket_mb, rep.reduce_stream) == (2, 25, "dp")
    with pytest.raises(DirectiveError, match=r"segment s1 .* placed on \[1, 3\]"):
        strategy.apply(_graph(microbatches=2))  # {"PP": "*"} also matches s1, on other devices


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"op": "replicate", "filter": {"PP": 0}}, r"replicate needs field\(s\) \['devices'\]"),
        ({"op": "replicate", "devices": [0, 1]}, r"replicate needs field\(s\) \['filter'\]"),
        ({"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1], "zero": 9}, "zero must be one of"),
        ({"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1], "zero": "1"}, "zero must be one of"),
        ({"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1], "bucket_mb": 0}, "bucket_mb must be a positive"),
        ({"op": "replicate", "filter": {"PP": 0}, "devices": "0,1"}, "devices must be an int or a list of ints"),
        ({"op": "replicate", "filter": [0], "devices": [0, 1]}, "a filter is an object"),
        ({"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1], "shards": 2}, r"replicate has no field\(s\) \['shards'\]"),
    ],
)
def test_json_malformed_replicate(item: dict, message: str) -> None:
    with pytest.raises(DirectiveError, match=message) as err:
        Strategy.from_json(json.dumps({"directives": [item]}), source="dp.json")
    assert "dp.json#0" in str(err.value)


def test_order_sees_every_replica() -> None:
    strategy = Strategy([Split(2), Place({"PP": 0}, (0, 1)), Order([{"PP": 0, "PASS": "F", "MB": 1},
                                                                    {"PP": 0, "PASS": "F", "MB": 0}])])
    graph = strategy.apply(_graph(stages=1, microbatches=2))
    edges = [e for e in graph.edges if e.kind is EdgeKind.TEMPORAL]
    assert [(e.src, e.dst) for e in edges] == [("F.s0.mb1", "F.s0.mb0")]  # one node on both devices
    assert all(n.devices == (0, 1) for n in graph.nodes if n.kind is NodeKind.COMPUTE)
