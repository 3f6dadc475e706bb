"""``validate``'s edge checks raise for the first bad edge in graph order, whichever rule it
breaks, and whether or not the graph's successor and predecessor tables were built before
(``validate`` skips the node lookups when those tables list only the graph's nodes)."""

from __future__ import annotations

import pytest

from piper_ir import (
    Edge,
    EdgeKind,
    Graph,
    Node,
    NodeKind,
    Phase,
    TensorMeta,
    ValidationError,
    Value,
    validate,
)


def _graph(edges: list[Edge]) -> Graph:
    meta = TensorMeta((4,), "float32")
    nodes = [Node(n, NodeKind.COMPUTE, None, Phase.F, 0) for n in ("a", "b", "c")]
    return Graph(segments=[], values=[Value("v", meta)], nodes=nodes, edges=edges)


GOOD = Edge("a", "b", EdgeKind.DATA, "v")
BAD_VALUE = Edge("b", "c", EdgeKind.DATA, "nope")
CASES = {
    "value, then node": ([GOOD, BAD_VALUE, Edge("c", "ghost")], "carries unknown value 'nope'"),
    "node, then value": ([GOOD, Edge("ghost", "c"), BAD_VALUE], "names unknown node 'ghost'"),
    "dst unknown": ([Edge("a", "ghost"), GOOD], "names unknown node 'ghost'"),
    "value only": ([GOOD, BAD_VALUE], "carries unknown value 'nope'"),
}


@pytest.mark.parametrize("tables_built", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_first_bad_edge_is_named(case: str, tables_built: bool) -> None:
    edges, message = CASES[case]
    graph = _graph(edges)
    if tables_built:
        graph.successors, graph.predecessors  # noqa: B018 - built and cached, as the cycle check builds them
    with pytest.raises(ValidationError, match=message):
        validate(graph, cycles=False)


def test_good_edges_pass() -> None:
    graph = _graph([GOOD, Edge("b", "c"), Edge("a", "c", EdgeKind.TEMPORAL, "not a value")])
    assert validate(graph, cycles=False) is graph
