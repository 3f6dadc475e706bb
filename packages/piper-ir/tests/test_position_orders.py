"""``Graph.predecessor_positions`` against the edges, ``predecessors`` made on demand, and
``rank_order_positions`` against ``rank_orders``."""

from __future__ import annotations

import attrs
import pytest

from piper_ir import Edge, EdgeKind, Graph, Node, NodeKind, Phase, rank_order_positions, rank_orders


def _graph() -> Graph:
    """Two ranks, two microbatches: F then B of two segments with a send/recv pair per
    microbatch and direction, a doubled edge, nodes out of topological order."""
    nodes, edges = [], []
    for mb in range(2):
        for seg, rank in (("s0", 0), ("s1", 1)):
            for phase in (Phase.B, Phase.F):
                nodes.append(Node(f"{phase.value}.{seg}.mb{mb}", NodeKind.COMPUTE, seg, phase, mb, devices=(rank,)))
        for kind, d, p in ((NodeKind.SEND, 0, 1), (NodeKind.RECV, 1, 0)):
            nodes.append(Node(f"{kind.value}.a.mb{mb}", kind, devices=(d,), peers=(p,), value="a"))
            nodes.append(Node(f"{kind.value}.g.mb{mb}", kind, devices=(p,), peers=(d,), value="grad:a"))
        chain = [f"F.s0.mb{mb}", f"send.a.mb{mb}", f"recv.a.mb{mb}", f"F.s1.mb{mb}", f"B.s1.mb{mb}",
                 f"send.g.mb{mb}", f"recv.g.mb{mb}", f"B.s0.mb{mb}"]
        edges += [Edge(a, b) for a, b in zip(chain, chain[1:], strict=False)]
    edges.append(Edge("F.s0.mb0", "B.s0.mb0", EdgeKind.TEMPORAL))
    edges.append(Edge("F.s0.mb0", "B.s0.mb0", EdgeKind.TEMPORAL))  # twice: counted twice
    edges.append(Edge("B.s1.mb0", "F.s1.mb1", EdgeKind.TEMPORAL))
    return Graph((), (), nodes, edges, world_size=2, microbatches=2)


def test_predecessor_positions_are_the_predecessors_by_position() -> None:
    g = _graph()
    position = {n.id: i for i, n in enumerate(g.nodes)}
    keyed: dict[str, list[Edge]] = {n.id: [] for n in g.nodes}
    for e in g.edges:
        keyed[e.dst].append(e)
    assert g.predecessor_positions == [[position[e.src] for e in keyed[n.id]] for n in g.nodes]
    assert g.predecessors == keyed  # made on demand, from the edges, in edge order
    assert sum(map(len, g.predecessor_positions)) == len(g.edges)


def test_no_positions_without_known_ends() -> None:
    g = _graph()
    unknown = attrs.evolve(g, edges=(*g.edges, Edge("F.s0.mb0", "nowhere")))
    assert unknown.successor_positions is None and unknown.predecessor_positions is None
    assert list(unknown.predecessors)[-1] == "nowhere"
    with pytest.raises(ValueError, match="unique"):
        rank_order_positions(unknown)


def test_rank_order_positions_are_rank_orders_by_position() -> None:
    g = _graph()
    for listed in ((), (NodeKind.SEND, NodeKind.RECV)):
        by_position = rank_order_positions(g, listed)
        assert by_position is not None
        assert [[g.nodes[i].id for i in order] for order in by_position] == rank_orders(g, listed)
    assert rank_orders(g) == [
        ["F.s0.mb0", "F.s0.mb1", "B.s0.mb0", "B.s0.mb1"],
        ["F.s1.mb0", "B.s1.mb0", "F.s1.mb1", "B.s1.mb1"],
    ]
    cyclic = attrs.evolve(g, edges=(*g.edges, Edge("B.s0.mb1", "F.s0.mb0", EdgeKind.TEMPORAL)))
    assert rank_order_positions(cyclic) is None and rank_orders(cyclic) is None
