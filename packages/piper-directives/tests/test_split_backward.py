"""Split backward: an Order naming BI/BW for a chunk splits that chunk's B, and only it."""

import pytest

from piper_directives import Order, Place, Split, Strategy, requested_splits, split_backward
from piper_ir import DirectiveError, Edge, EdgeKind, NodeKind, Phase, validate


def _places():
    # s0 on device 0; s1, s2 and the loss on device 1 (s0 -> s2 is a skip connection)
    return [Place({"PP": 0}, 0), Place({"PP": 1}, 1), Place({"PP": 2}, 1)]


def _fused(stage, mb):
    return [{"PP": stage, "PASS": "B", "MB": mb}]


def _rank1_order(split_mbs=(0,), m=2):
    """F of every microbatch, then the backwards; s1's backward split for ``split_mbs``."""
    slots = [[{"PP": 1, "PASS": "F", "MB": i}, {"PP": 2, "PASS": "F", "MB": i}, {"SEG": "loss", "PASS": "F", "MB": i}]
             for i in range(m)]
    for i in range(m):
        slots.append([{"SEG": "loss", "PASS": "B", "MB": i}, {"PP": 2, "PASS": "B", "MB": i}])
        slots.append([{"PP": 1, "PASS": "BI", "MB": i}] if i in split_mbs else _fused(1, i))
    slots += [[{"PP": 1, "PASS": "BW", "MB": i}] for i in split_mbs]
    return Order(slots, name="rank1")


def _apply(three_stage, *orders, m=2):
    return Strategy([Split(m), *_places(), *orders]).apply(three_stage.graph)


def _edges(g, node_id):
    ins = {(e.src, e.kind, e.value) for e in g.edges if e.dst == node_id}
    outs = {(e.dst, e.kind, e.value) for e in g.edges if e.src == node_id}
    return ins, outs


def test_split_one_chunk_rewires_its_edges(three_stage):
    g = _apply(three_stage, _rank1_order(split_mbs=(0,)))
    ids = g.node_by_id
    assert "B.s1.mb0" not in ids and {"BI.s1.mb0", "BW.s1.mb0", "B.s1.mb1"} <= set(ids)
    bi, bw = ids["BI.s1.mb0"], ids["BW.s1.mb0"]
    assert (bi.phase, bw.phase) == (Phase.BI, Phase.BW)
    assert bi.devices == bw.devices == (1,) and bi.segment == bw.segment == "s1" and bi.microbatch == 0
    data_in, data_out = _edges(g, "BI.s1.mb0")
    data_in = {x for x in data_in if x[1] is EdgeKind.DATA}
    # saved activations and the gradient of s1's output (from s2's backward, same device)
    assert data_in == {("F.s1.mb0", EdgeKind.DATA, None), ("B.s2.mb0", EdgeKind.DATA, "grad:v:tanh_1")}
    # the input gradient goes to the send towards s0, then BW
    send = "send.grad:v:tanh.mb0.1-0"
    assert (send, EdgeKind.DATA, "grad:v:tanh") in data_out
    assert ("BW.s1.mb0", EdgeKind.DATA, None) in data_out
    assert not any(dst == "OPT.s1" for dst, _, _ in data_out)
    bw_in, bw_out = _edges(g, "BW.s1.mb0")
    assert ("BI.s1.mb0", EdgeKind.DATA, None) in bw_in
    assert ("OPT.s1", EdgeKind.DATA, None) in bw_out
    assert not any(kind is EdgeKind.DATA and value for _, kind, value in bw_out)  # BW sends no gradient
    # the other microbatch keeps its fused backward, with the same consumers as before
    assert ("OPT.s1", EdgeKind.DATA, None) in _edges(g, "B.s1.mb1")[1]
    # the Order placed BW after the last fused backward on device 1
    assert Edge("B.s1.mb1", "BW.s1.mb0", EdgeKind.TEMPORAL) in {
        Edge(e.src, e.dst, e.kind) for e in g.edges if e.kind is EdgeKind.TEMPORAL
    }
    validate(g)


def test_wildcard_microbatch_splits_every_chunk(three_stage):
    order = Order(
        [[{"PP": "*", "PASS": "F", "MB": "*"}, {"SEG": "loss", "PASS": "*", "MB": "*"}],
         [{"PP": 2, "PASS": "BI", "MB": "*"}], [{"PP": 2, "PASS": "BW", "MB": "*"}],
         [{"PP": 1, "PASS": "B", "MB": "*"}]],
        name="wild",
    )
    order0 = Order([[{"PP": 0, "PASS": "F", "MB": "*"}], [{"PP": 0, "PASS": "B", "MB": "*"}]])
    g = _apply(three_stage, order, order0, m=4)
    phases = {(n.segment, n.microbatch): n.phase for n in g.nodes if n.kind is NodeKind.COMPUTE and n.phase is not Phase.F}
    for i in range(4):
        assert phases[("s0", i)] is Phase.B and phases[("s1", i)] is Phase.B
    assert {n.id for n in g.nodes if n.phase in (Phase.BI, Phase.BW)} == {
        f"{p}.s2.mb{i}" for p in ("BI", "BW") for i in range(4)
    }


def test_split_loss_chunk_too(three_stage):
    """A segment without parameters may be split: its BW only ends the chunk."""
    slots = [[{"PP": 1, "PASS": "F", "MB": 0}, {"PP": 2, "PASS": "F", "MB": 0}, {"SEG": "loss", "PASS": "F", "MB": 0}],
             [{"SEG": "loss", "PASS": "BI", "MB": 0}], [{"SEG": "loss", "PASS": "BW", "MB": 0}]]
    g = _apply(three_stage, Order(slots), m=1)
    assert {"BI.loss.mb0", "BW.loss.mb0"} <= set(g.node_by_id)
    assert _edges(g, "BW.loss.mb0")[1] == set()  # no optimizer for the loss


@pytest.mark.parametrize(("half", "other"), [("BI", "BW"), ("BW", "BI")])
def test_one_half_without_the_other_is_rejected(three_stage, half, other):
    order = Order([[{"PP": 2, "PASS": half, "MB": 1}]], name="lonely")
    with pytest.raises(DirectiveError, match=f"ordered as {half} but no Order places its {other}") as info:
        _apply(three_stage, order)
    assert "lonely" in str(info.value) and "B.s2.mb1" in info.value.nodes


def test_halves_in_different_orders_pair_up(three_stage):
    a = Order([[{"PP": 2, "PASS": "F", "MB": 0}], [{"PP": 2, "PASS": "BI", "MB": 0}]], name="a")
    b = Order([[{"PP": 2, "PASS": "BW", "MB": 0}]], name="b")
    g = _apply(three_stage, a, b)
    assert {"BI.s2.mb0", "BW.s2.mb0"} <= set(g.node_by_id)


def test_fused_and_split_for_one_chunk_is_rejected(three_stage):
    order = Order([_fused(2, 0), [{"PP": 2, "PASS": "BI", "MB": 0}], [{"PP": 2, "PASS": "BW", "MB": 0}]])
    with pytest.raises(DirectiveError, match="both as a fused B and as BI/BW"):
        _apply(three_stage, order)


def test_bw_before_bi_is_a_cycle(three_stage):
    order = Order([[{"PP": 2, "PASS": "BW", "MB": 0}], [{"PP": 2, "PASS": "BI", "MB": 0}]], name="backwards")
    with pytest.raises(DirectiveError, match="cycle") as info:
        _apply(three_stage, order)
    assert "backwards" in str(info.value)


def test_no_request_leaves_the_graph_alone(three_stage):
    placed = Strategy([Split(2), *_places()]).apply(three_stage.graph)
    assert requested_splits(placed, [Order([_fused(1, 0)])]) == {}
    assert split_backward(placed, {}) is placed


def test_halves_named_in_a_set_of_passes_are_requested(three_stage):
    # The request is found where a filter names a half among other passes, not only alone.
    placed = Strategy([Split(2), *_places()]).apply(three_stage.graph)
    both = Order([[{"PP": 1, "PASS": ("BI", "BW"), "MB": 1}]], name="both")
    assert set(requested_splits(placed, [Order([_fused(1, 0)]), both])) == {"B.s1.mb1"}
    with pytest.raises(DirectiveError, match="no Order places its BW"):
        requested_splits(placed, [Order([[{"PP": 1, "PASS": ("F", "BI"), "MB": 0}]])])


def test_split_backward_rejects_non_backward_nodes(three_stage):
    placed = Strategy([Split(2), *_places()]).apply(three_stage.graph)
    with pytest.raises(DirectiveError, match="not a fused backward"):
        split_backward(placed, ["F.s1.mb0"])


def test_json_strategy_with_split_backward(three_stage):
    strategy = Strategy([Split(2), *_places(), _rank1_order(split_mbs=(0, 1))])
    again = Strategy.from_json(strategy.to_json())
    a, b = again.apply(three_stage.graph), strategy.apply(three_stage.graph)
    # equal up to ``origin``, which names where each directive was written
    assert [(n.id, n.phase) for n in a.nodes] == [(n.id, n.phase) for n in b.nodes]
    assert [(e.src, e.dst, e.kind, e.value) for e in a.edges] == [(e.src, e.dst, e.kind, e.value) for e in b.edges]
    assert {"BI.s1.mb1", "BW.s1.mb1"} <= set(a.node_by_id)
