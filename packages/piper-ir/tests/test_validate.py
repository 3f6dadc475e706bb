"""One negative test per ``validate`` message, plus the positive baseline."""

from __future__ import annotations

import sys

import attrs
import pytest

from piper_ir import (
    Edge,
    EdgeKind,
    Graph,
    Node,
    NodeKind,
    Phase,
    PiperError,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
    ValidationError,
    Value,
    validate,
)


def _base() -> Graph:
    """F.s0 -> F.s1 on two devices with a send/recv pair, two microbatches."""
    meta = TensorMeta((4, 8), "float32", batch_dim=0, requires_grad=True)
    return Graph(
        segments=[
            Segment("s0", SegmentRole.STAGE, Tags.of(PP=0), ("input:0",), ("v:a",)),
            Segment("s1", SegmentRole.STAGE, Tags.of(PP=1), ("v:a",), ("v:b",)),
        ],
        values=[Value("input:0", meta), Value("v:a", meta), Value("v:b", meta)],
        nodes=[
            Node("F.s0.mb0", NodeKind.COMPUTE, "s0", Phase.F, 0, Tags.of(PP=0), devices=(0,)),
            Node("send", NodeKind.SEND, microbatch=0, devices=(0,), peers=(1,), value="v:a", stream="pp"),
            Node("recv", NodeKind.RECV, microbatch=0, devices=(1,), peers=(0,), value="v:a", stream="pp"),
            Node("F.s1.mb1", NodeKind.COMPUTE, "s1", Phase.F, 1, Tags.of(PP=1), devices=(1,)),
        ],
        edges=[
            Edge("F.s0.mb0", "send", EdgeKind.DATA, "v:a"),
            Edge("send", "recv", EdgeKind.DATA, "v:a"),
            Edge("recv", "F.s1.mb1", EdgeKind.DATA, "v:a"),
        ],
        inputs=("input:0",),
        microbatches=2,
        world_size=2,
    )


def _replace_node(graph: Graph, node_id: str, **changes: object) -> Graph:
    nodes = [attrs.evolve(n, **changes) if n.id == node_id else n for n in graph.nodes]
    return attrs.evolve(graph, nodes=nodes)


def test_base_graph_is_valid() -> None:
    graph = _base()
    assert validate(graph) is graph


def test_unplaced_graph_skips_world_size_check() -> None:
    # world_size 0 means "not placed yet": any device numbers are allowed.
    validate(attrs.evolve(_base(), world_size=0))


def test_duplicate_node_id() -> None:
    graph = _base()
    graph = attrs.evolve(graph, nodes=graph.nodes + (graph.nodes[0],))
    with pytest.raises(ValidationError, match="duplicate node id 'F.s0.mb0'"):
        validate(graph)


def test_duplicate_segment_id() -> None:
    graph = _base()
    graph = attrs.evolve(graph, segments=graph.segments + (graph.segments[0],))
    with pytest.raises(ValidationError, match="duplicate segment id 's0'"):
        validate(graph)


def test_duplicate_value_name() -> None:
    graph = _base()
    graph = attrs.evolve(graph, values=graph.values + (graph.values[1],))
    with pytest.raises(ValidationError, match="duplicate value name 'v:a'"):
        validate(graph)


@pytest.mark.parametrize("end", ["src", "dst"])
def test_dangling_edge(end: str) -> None:
    graph = _base()
    edge = attrs.evolve(graph.edges[0], **{end: "ghost"})
    graph = attrs.evolve(graph, edges=(edge,) + graph.edges[1:])
    with pytest.raises(ValidationError, match="names unknown node 'ghost'") as info:
        validate(graph)
    assert info.value.nodes == ("ghost",)


def test_unknown_value_on_edge() -> None:
    graph = _base()
    graph = attrs.evolve(graph, edges=graph.edges + (Edge("F.s0.mb0", "F.s1.mb1", EdgeKind.DATA, "v:nope"),))
    with pytest.raises(ValidationError, match="carries unknown value 'v:nope'") as info:
        validate(graph)
    assert info.value.nodes == ("F.s0.mb0", "F.s1.mb1")


def test_temporal_edge_value_is_not_checked() -> None:
    graph = _base()
    validate(attrs.evolve(graph, edges=graph.edges + (Edge("F.s0.mb0", "F.s1.mb1", EdgeKind.TEMPORAL, "x"),)))


def test_unknown_segment() -> None:
    with pytest.raises(ValidationError, match="node F.s0.mb0 names unknown segment 's9'") as info:
        validate(_replace_node(_base(), "F.s0.mb0", segment="s9"))
    assert info.value.nodes == ("F.s0.mb0",)


@pytest.mark.parametrize("microbatch", [2, -1])
def test_microbatch_out_of_range(microbatch: int) -> None:
    with pytest.raises(ValidationError, match=rf"microbatch {microbatch} outside \[0, 2\)"):
        validate(_replace_node(_base(), "F.s1.mb1", microbatch=microbatch))


def test_device_named_twice() -> None:
    with pytest.raises(ValidationError, match=r"names a device twice: \[1, 1\]"):
        validate(_replace_node(_base(), "F.s1.mb1", devices=(1, 1)))


@pytest.mark.parametrize("devices", [(2,), (-1,), (0, 5)])
def test_device_outside_world_size(devices: tuple[int, ...]) -> None:
    with pytest.raises(ValidationError, match="outside world size 2"):
        validate(_replace_node(_base(), "F.s0.mb0", devices=devices))


@pytest.mark.parametrize("node_id", ["send", "recv"])
def test_send_recv_with_mismatched_peers(node_id: str) -> None:
    with pytest.raises(ValidationError, match=rf"{node_id} node {node_id} has peers \[\] for devices"):
        validate(_replace_node(_base(), node_id, peers=()))


def _with_cycle() -> Graph:
    graph = _base()
    extra = (
        Edge("F.s1.mb1", "F.s0.mb0", EdgeKind.TEMPORAL, origin="Order(...) at strategy.py:12"),
        # A chord between two nodes of the cycle that is not itself on the cycle: its
        # directive must not be blamed.
        Edge("F.s0.mb0", "recv", EdgeKind.TEMPORAL, origin="Innocent() at strategy.py:3"),
        # An edge outside the cycle altogether.
        Edge("recv", "extra", EdgeKind.TEMPORAL, origin="Other() at strategy.py:99"),
    )
    nodes = graph.nodes + (Node("extra", NodeKind.MARKER),)
    return attrs.evolve(graph, nodes=nodes, edges=graph.edges + extra)


def test_cycle_names_nodes_and_directive() -> None:
    with pytest.raises(ValidationError, match="the graph has a cycle") as info:
        validate(_with_cycle())
    err = info.value
    assert set(err.nodes) == {"F.s0.mb0", "send", "recv", "F.s1.mb1"}
    assert err.nodes[0] == err.nodes[-1]
    assert err.directive == "Order(...) at strategy.py:12"
    text = str(err)
    assert "directive: Order(...) at strategy.py:12" in text
    assert "F.s1.mb1" in text and "Other()" not in text and "Innocent()" not in text


def test_cycle_without_origin_has_no_directive() -> None:
    graph = _base()
    graph = attrs.evolve(graph, edges=graph.edges + (Edge("recv", "send", EdgeKind.TEMPORAL),))
    with pytest.raises(ValidationError, match="send -> recv -> send") as info:
        validate(graph)
    assert info.value.directive is None


def test_self_loop_is_a_cycle() -> None:
    graph = _base()
    graph = attrs.evolve(
        graph, edges=graph.edges + (Edge("send", "send", EdgeKind.TEMPORAL, origin="Loop()"),)
    )
    with pytest.raises(ValidationError, match="send -> send") as info:
        validate(graph)
    assert info.value.directive == "Loop()"


def test_validation_error_is_a_piper_error_and_pickles() -> None:
    import pickle

    with pytest.raises(PiperError) as info:
        validate(_with_cycle())
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is ValidationError
    assert (copy.message, copy.directive, copy.nodes) == (
        info.value.message,
        info.value.directive,
        info.value.nodes,
    )
    assert str(copy) == str(info.value)


def test_a_graph_that_passed_is_not_walked_again_but_its_cycles_still_are(monkeypatch) -> None:
    module = sys.modules[validate.__module__]  # piper_ir.validate is the function too
    walks: list[str] = []
    unique = module._unique
    monkeypatch.setattr(module, "_unique", lambda what, *rest: (walks.append(what), unique(what, *rest)))
    graph = _base()
    assert validate(graph) is graph and validate(graph) is graph and validate(graph, cycles=False) is graph
    assert walks.count("node id") == 1  # a frozen graph that passed stays valid
    assert validate(_base()) is not graph and walks.count("node id") == 2  # an equal graph is another object
    cyclic = _with_cycle()
    assert validate(cyclic, cycles=False) is cyclic  # passing without the cycle check ...
    with pytest.raises(ValidationError, match="the graph has a cycle"):
        validate(cyclic)  # ... does not pass it
