import json
import sys

import pytest

from piper_directives import (
    DIRECTIVES,
    ContextParallel,
    Order,
    Place,
    Recompute,
    Replicate,
    Shard,
    Split,
    Strategy,
    build_schedule,
    gpipe,
    one_f_one_b,
    parallelize,
    written_at,
)
from piper_ir import DirectiveError, EdgeKind, Filter, NodeKind, ShardKind, from_json, to_json, validate


def _place3():
    return [Place({"PP": i}, i) for i in range(3)]


def test_split_copies_compute_per_microbatch_and_divides_metas(three_stage):
    g = Split(4).apply(three_stage.graph)
    assert g.microbatches == 4
    assert len([n for n in g.nodes if n.kind is NodeKind.COMPUTE]) == 8 * 4
    assert len([n for n in g.nodes if n.kind is NodeKind.OPTIMIZER]) == 3
    assert g.value_by_name["input:0"].meta.shape == (2, 4)
    opt_preds = {e.src for e in g.edges if e.dst == "OPT.s1"}
    assert opt_preds == {f"B.s1.mb{i}" for i in range(4)}
    validate(g)


@pytest.mark.parametrize("m", [0, -1, 2.5, True])
def test_split_rejects_bad_counts(three_stage, m):
    with pytest.raises(DirectiveError, match="positive int"):
        Split(m).apply(three_stage.graph)


def test_split_rejects_indivisible_batch(three_stage):
    with pytest.raises(DirectiveError, match=r"value input:0 has 8 samples.*not divisible into 3"):
        Split(3).apply(three_stage.graph)


def test_split_twice_is_rejected(three_stage):
    with pytest.raises(DirectiveError, match="once"):
        Strategy([Split(2), Split(2), *_place3()]).apply(three_stage.graph)


def test_place_inserts_matched_send_recv_pairs(three_stage):
    g = Strategy([Split(2), *_place3()]).apply(three_stage.graph)
    assert g.world_size == 3
    sends = [n for n in g.nodes if n.kind is NodeKind.SEND]
    recvs = [n for n in g.nodes if n.kind is NodeKind.RECV]
    # per microbatch: s0->s1, s0->s2 (skip), s1->s2 activations and their three gradients
    assert len(sends) == len(recvs) == 2 * 6
    for s in sends:
        assert s.stream == "pp" and len(s.peers) == 1
        r = g.node("recv" + s.id[len("send"):])
        assert (r.devices, r.peers) == (s.peers, s.devices)
    loss_nodes = [n for n in g.nodes if n.segment == "loss"]
    assert {n.devices for n in loss_nodes} == {(2,)}
    for e in g.edges:
        if e.kind is EdgeKind.DATA and e.value:
            assert g.node(e.src).devices == g.node(e.dst).devices or g.node(e.src).kind is NodeKind.SEND


def test_place_leaving_a_stage_unplaced(three_stage):
    with pytest.raises(DirectiveError, match=r"not placed by any Place directive: s2 \(PP=2\)"):
        Strategy([Place({"PP": 0}, 0), Place({"PP": 1}, 1)]).apply(three_stage.graph)


def test_place_naming_a_device_twice(three_stage):
    with pytest.raises(DirectiveError, match=r"device 1 is named twice") as err:
        Strategy([Place({"PP": "*"}, (0, 1, 1))]).apply(three_stage.graph)
    assert "test_directives.py" in str(err.value)  # where the user wrote it


def test_a_directive_names_the_first_line_outside_piper_or_what_written_at_says():
    """A schedule built for the user by another Piper package (``piper_train``'s Trainer)
    names the user's line; one made from a command's flags names the flags."""
    made_by_piper = {"__name__": "piper_train.elsewhere", "build_schedule": build_schedule}
    line = sys._getframe().f_lineno + 1
    strategy = eval("build_schedule('1f1b', 2, 4)", made_by_piper)  # code whose frame is piper_train's
    assert {d.where for d in strategy.directives} == {f"test_directives.py:{line}"}
    with written_at("the command line (--pp 2)"):
        with written_at("--strategy s.csv"):
            assert Split(2).where == "--strategy s.csv"
        assert Split(2).where == "the command line (--pp 2)"
        widened = parallelize(strategy, dp=2)
    assert Split(2).where.startswith("test_directives.py:")
    # Places keep where they were written; the Replicates parallelize adds say what asked for them
    assert {d.where for d in widened.directives if isinstance(d, Place)} == {f"test_directives.py:{line}"}
    assert {d.where for d in widened.directives if isinstance(d, Replicate)} == {"the command line (--pp 2)"}


def test_place_conflict_and_no_match(three_stage):
    with pytest.raises(DirectiveError, match="placed twice"):
        Strategy([*_place3(), Place({"PP": 1}, 0)]).apply(three_stage.graph)
    with pytest.raises(DirectiveError, match="matches no annotated region"):
        Strategy([*_place3(), Place({"PP": 7}, 0)]).apply(three_stage.graph)


def test_place_with_a_gap_in_device_numbers(three_stage):
    """The first Place beyond the gap is named (directive and where it was written)."""
    with pytest.raises(DirectiveError, match=r"this Place names device 2, but device 1 holds no region") as info:
        Strategy([Place({"PP": 0}, 0), Place({"PP": 1}, 2), Place({"PP": 2}, 2)]).apply(three_stage.graph)
    assert info.value.directive.startswith("Place({PP: 1}, devices=[2]")
    with pytest.raises(DirectiveError, match=r"names device 99, but devices 1\.\.98 hold no region"):
        Strategy([Place({"PP": 0}, 0), Place({"PP": 1}, 0), Place({"PP": 2}, 99)]).apply(three_stage.graph)


def test_place_by_microbatch_makes_mirrored_replicas(three_stage):
    """A Place naming MB places only those microbatches; a region whose microbatches run on
    different devices keeps its parameters (and optimizer) on all of them, replicated with
    gradients summed and the batch not sharded (DualPipe's mirrored stages)."""
    places = [Place({"PP": 0}, 0), Place({"PP": 1, "MB": 0}, 1), Place({"PP": 1, "MB": (1,)}, 2), Place({"PP": 2}, 2)]
    g = Strategy([Split(2), *places]).apply(three_stage.graph)
    assert g.node("F.s1.mb0").devices == (1,) and g.node("B.s1.mb1").devices == (2,)
    assert g.node("OPT.s1").devices == (1, 2) and g.node("OPT.s0").devices == (0,)
    assert [(r.segment, r.devices, r.zero) for r in g.replication] == [("s1", (1, 2), 0)]
    assert g.value_by_name["input:0"].meta.shape == (4, 4)  # one microbatch, not sharded
    assert {n.devices for n in g.nodes if n.segment == "loss"} == {(2,)}
    sends = {(n.microbatch, n.devices, n.peers) for n in g.nodes if n.kind is NodeKind.SEND and n.tags.get("PP") == 0}
    assert {(mb, d) for mb, _, d in sends} >= {(0, (1,)), (1, (2,))}


def test_place_by_microbatch_errors(three_stage):
    with pytest.raises(DirectiveError, match=r"not placed by any Place directive: s1 \(PP=1\) microbatches \[1\]"):
        Strategy([Split(2), *_place3()[::2], Place({"PP": 1, "MB": 0}, 1)]).apply(three_stage.graph)
    with pytest.raises(DirectiveError, match="segment s1 microbatch 1 is placed twice"):
        Strategy([Split(2), *_place3(), Place({"PP": 1, "MB": (1,)}, 2)]).apply(three_stage.graph)
    with pytest.raises(DirectiveError, match="names microbatches the graph does not have"):
        Strategy([Split(2), *_place3(), Place({"PP": 1, "MB": 5}, 1)]).apply(three_stage.graph)


def test_order_cycle_names_directive_and_nodes(three_stage):
    backwards = Order([{"PP": 1, "PASS": "F", "MB": 0}, {"PP": 1, "PASS": "B", "MB": 0}, {"PP": 1, "PASS": "F", "MB": 1}, {"PP": 1, "PASS": "B", "MB": 1}])
    ok = Strategy([Split(2), *_place3(), backwards]).apply(three_stage.graph)
    assert ok.world_size == 3
    bad = Order([{"PP": 0, "PASS": "B", "MB": 0}, {"PP": 0, "PASS": "F", "MB": 0}], name="my-order")
    with pytest.raises(DirectiveError, match=r"cycle .*F\.s0\.mb0") as err:
        Strategy([Split(2), *_place3(), bad]).apply(three_stage.graph)
    assert "my-order" in str(err.value) and "test_directives.py" in str(err.value)
    assert "B.s0.mb0" in err.value.nodes


def test_order_slot_errors(three_stage):
    with pytest.raises(DirectiveError, match="slot 1 .* matches no compute node"):
        Strategy([Split(2), *_place3(), Order([{"PP": 0, "PASS": "F", "MB": 0}, {"PP": 9}])]).apply(three_stage.graph)
    dup = Order([{"PP": 0, "PASS": "F", "MB": 0}, {"PP": 0, "PASS": "F"}])
    with pytest.raises(DirectiveError, match="matched by slots 0 and 1"):
        Strategy([Split(2), *_place3(), dup]).apply(three_stage.graph)


def _compute_order(graph, device):
    """The chain of one device's stage nodes, following temporal edges."""
    temporal = [e for e in graph.edges if e.kind is EdgeKind.TEMPORAL]
    mine = {
        n.id for n in graph.nodes
        if n.devices == (device,) and n.segment != "loss" and n.kind is NodeKind.COMPUTE
    }
    after = {n: {e.dst for e in temporal if e.src == n and e.dst in mine} for n in mine}
    (first,) = mine - {d for ds in after.values() for d in ds}
    chain = [first]
    while after[chain[-1]]:
        (nxt,) = after[chain[-1]]
        chain.append(nxt)
    return [f"{graph.node(n).phase.value}{graph.node(n).microbatch}" for n in chain]


def test_one_f_one_b_order(three_stage):
    g = one_f_one_b(3, 4).apply(three_stage.graph)
    assert _compute_order(g, 0) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert _compute_order(g, 2) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    g = gpipe(3, 2).apply(three_stage.graph)
    assert _compute_order(g, 1) == ["F0", "F1", "B0", "B1"]


def test_several_stages_per_rank(three_stage):
    with pytest.raises(DirectiveError, match="3 stages cannot be spread evenly over 2"):
        build_schedule("1f1b", 2, 4, stages=3)
    g = build_schedule("gpipe", 1, 2, stages=3).apply(three_stage.graph)
    assert g.world_size == 1 and not [n for n in g.nodes if n.kind is NodeKind.SEND]
    with pytest.raises(DirectiveError, match="unknown schedule 'zigzag'"):
        build_schedule("zigzag", 2, 2)


def test_strategy_json_round_trip_and_graph_json(three_stage):
    s = one_f_one_b(3, 2)
    again = Strategy.from_json(s.to_json())
    assert again == s
    g = again.apply(three_stage.graph)
    assert from_json(to_json(g)) == g


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "expected an object"),
        ('{"directives": [{"microbatches": 2}]}', 'with an "op" field'),
        ('{"directives": [{"op": "expert"}]}', "unknown op 'expert'"),
        ('{"directives": [{"op": ["split"]}]}', r"unknown op \['split'\]; expected one of \['context_parallel', 'order', 'place', 'recompute', 'replicate', 'shard', 'split'\]"),
        ('{"directives": [{"op": "shard"}]}', r"shard needs field\(s\) \['devices', 'filter'\]"),
        ('{"directives": [{"op": "split"}]}', r"split needs field\(s\) \['microbatches'\]"),
        ('{"directives": [{"op": "split", "microbatches": 2, "chunks": 3}]}', r"has no field\(s\) \['chunks'\]"),
        ('{"directives": [{"op": "place", "filter": {"PP": 0}, "devices": "zero"}]}', "devices must be an int or a list"),
        ('{"directives": [{"op": "place", "filter": [0], "devices": 0}]}', "a filter is an object"),
        ('{"directives": [{"op": "order", "slots": []}]}', "slots must be a non-empty list"),
        ('{"directives": [{"op": "place", "filter": {"PP": 1.5}, "devices": 0}]}', "malformed place"),
    ],
)
def test_malformed_json_directives(doc, message):
    with pytest.raises(DirectiveError, match=message) as err:
        Strategy.from_json(doc, source="strategy.json")
    assert "strategy.json" in str(err.value)


def test_json_program_equivalent_to_python(three_stage):
    doc = {
        "directives": [
            {"op": "split", "microbatches": 2},
            *({"op": "place", "filter": {"PP": i}, "devices": [i]} for i in range(3)),
            {"op": "order", "slots": [[{"PP": 0, "PASS": "F", "MB": 0}], [{"PP": 0, "PASS": "F", "MB": 1}]]},
        ]
    }
    from_doc = Strategy.from_json(json.dumps(doc)).apply(three_stage.graph)
    from_py = Strategy([Split(2), *_place3(), Order([[Filter.of(PP=0, PASS="F", MB=0)], [Filter.of(PP=0, PASS="F", MB=1)]])]).apply(three_stage.graph)
    strip = lambda g: {(e.src, e.dst, e.kind) for e in g.edges}  # noqa: E731
    assert strip(from_doc) == strip(from_py)


# One of each directive, every field away from its default where it has one.
EVERY_DIRECTIVE = [
    (Split(3), '{"op": "split", "microbatches": 3}'),
    (Recompute({"PP": 1}), '{"op": "recompute", "filter": {"PP": 1}}'),
    (Place({"PP": 1, "MB": (0, 2)}, (1, 3), stream="pp2"),
     '{"op": "place", "filter": {"MB": [0, 2], "PP": 1}, "devices": [1, 3], "stream": "pp2"}'),
    (Replicate({"PP": 0}, (0, 2), zero=2, bucket_mb=1.5, reduce_stream="r", gather_stream="g"),
     '{"op": "replicate", "filter": {"PP": 0}, "devices": [0, 2], "zero": 2, "bucket_mb": 1.5, "reduce_stream": "r", '
     '"gather_stream": "g"}'),
    (Shard({"PP": 0}, (0, 1, 2, 3), kind="ep", degree=2),
     '{"op": "shard", "filter": {"PP": 0}, "devices": [0, 1, 2, 3], "kind": "ep", "degree": 2}'),
    (Shard({"PP": 1}, (0, 1)), '{"op": "shard", "filter": {"PP": 1}, "devices": [0, 1], "kind": "tp"}'),
    (ContextParallel({"PP": 0}, (0, 1, 2, 3), degree=2),
     '{"op": "context_parallel", "filter": {"PP": 0}, "devices": [0, 1, 2, 3], "degree": 2}'),
    (Order([[{"PP": 0, "PASS": "F", "MB": 0}], {"SEG": "loss"}], name="mine"),
     '{"op": "order", "name": "mine", "slots": [[{"MB": 0, "PASS": "F", "PP": 0}], [{"SEG": "loss"}]]}'),
]


@pytest.mark.parametrize(("directive", "form"), EVERY_DIRECTIVE, ids=[type(d).__name__ + str(i) for i, (d, _) in enumerate(EVERY_DIRECTIVE)])
def test_every_registered_directive_round_trips_through_its_json_form(directive, form):
    assert json.dumps(directive.to_json()) == form
    again = Strategy.from_json(json.dumps({"directives": [json.loads(form)]}), source="s.json")
    assert again.directives == (directive,)
    assert again.directives[0].where == "s.json#0"


def test_every_directive_is_registered_once_by_its_op():
    assert {type(d) for d, _ in EVERY_DIRECTIVE} == set(DIRECTIVES)
    assert sorted(cls.op for cls in DIRECTIVES) == [
        "context_parallel", "order", "place", "recompute", "replicate", "shard", "split"]
    strategy = Strategy([d for d, _ in EVERY_DIRECTIVE])
    assert Strategy.from_json(strategy.to_json()) == strategy
    with pytest.raises(DirectiveError, match=r"is not a directive \(Split, Recompute, Place, Replicate, Shard, ContextParallel or Order\)"):
        Strategy([Split(2), "place"]).apply(None)


def test_shard_kind_is_a_shard_kind():
    assert Shard({"PP": 0}, (0, 1), kind="ep").kind is ShardKind.EP
    assert Shard({"PP": 0}, (0, 1)).kind is ShardKind.TP
    assert "kind='ep'" in str(Shard({"PP": 0}, (0, 1), kind=ShardKind.EP))
    with pytest.raises(DirectiveError, match=r"kind must be one of \['tp', 'ep', 'cp'\], got 'xp'") as err:
        Shard({"PP": 0}, (0, 1), kind="xp")
    assert "kind='xp'" in str(err.value)


def test_recompute_marks_the_regions_it_matches_before_place(three_stage):
    """Recompute is a property of segments: it runs before Place, wherever it is written, and
    leaves capture's own marks (torch.utils.checkpoint) alone."""
    strategy = Strategy([*_place3(), Recompute({"PP": (0, 2)}), Split(2)])
    placed = strategy.apply(three_stage.graph)
    assert {s.id: s.recompute for s in placed.stage_segments()} == {"s0": True, "s1": False, "s2": True}
    assert not placed.loss_segment().recompute
    assert Strategy.from_json(strategy.to_json()).apply(three_stage.graph) == placed


def test_recompute_refuses_a_filter_that_matches_no_region(three_stage):
    with pytest.raises(DirectiveError, match=r"filter \{PP: 7\} matches no annotated region") as err:
        Strategy([Split(2), *_place3(), Recompute({"PP": 7})]).apply(three_stage.graph)
    assert "Recompute({PP: 7}) at test_directives.py:" in str(err.value)
