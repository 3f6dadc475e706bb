"""topological_order, find_cycle, reachable and critical_path on small hand-made graphs."""

from __future__ import annotations

import pytest

from piper_ir import (
    Edge,
    EdgeKind,
    Graph,
    Node,
    NodeKind,
    critical_path,
    find_cycle,
    reachable,
    topological_order,
)


def _graph(node_ids: str, edges: list[str]) -> Graph:
    """``_graph("abcd", ["ab", "bc"])``: one-letter nodes, one edge per two-letter string."""
    nodes = [Node(n, NodeKind.COMPUTE) for n in node_ids]
    return Graph(
        (),
        (),
        nodes,
        [Edge(e[0], e[1], EdgeKind.DATA if i % 2 else EdgeKind.TEMPORAL) for i, e in enumerate(edges)],
    )


DIAMOND = _graph("dcba", ["ab", "ac", "bd", "cd"])  # a -> {b, c} -> d, nodes listed backwards


def test_topological_order_breaks_ties_by_node_order() -> None:
    assert topological_order(DIAMOND) == ["a", "c", "b", "d"]
    assert topological_order(_graph("zyx", [])) == ["z", "y", "x"]


def test_topological_order_breaks_ties_by_key() -> None:
    assert topological_order(DIAMOND, key=lambda n: n) == ["a", "b", "c", "d"]
    assert topological_order(_graph("zyx", []), key=lambda n: n) == ["x", "y", "z"]
    rank = {"b": 1, "c": 0}
    assert topological_order(DIAMOND, key=lambda n: rank.get(n, 0)) == ["a", "c", "b", "d"]


def test_topological_order_equal_keys_fall_back_to_node_order() -> None:
    assert topological_order(_graph("zyx", []), key=lambda n: 0) == ["z", "y", "x"]


def test_topological_order_respects_both_edge_kinds() -> None:
    graph = _graph("abc", ["cb", "ba"])  # temporal c->b, data b->a
    assert topological_order(graph) == ["c", "b", "a"]


def test_topological_order_of_cycle_is_none() -> None:
    assert topological_order(_graph("abc", ["ab", "bc", "cb"])) is None


def test_topological_order_empty() -> None:
    assert topological_order(_graph("", [])) == []


def test_find_cycle() -> None:
    assert find_cycle(DIAMOND) is None
    assert find_cycle(_graph("", [])) is None
    assert find_cycle(_graph("abcd", ["ab", "bc", "cd", "db"])) == ["b", "c", "d", "b"]
    assert find_cycle(_graph("ab", ["aa"])) == ["a", "a"]
    assert find_cycle(_graph("ab", ["ab", "ba"])) == ["a", "b", "a"]


def test_find_cycle_path_follows_edges() -> None:
    graph = _graph("abcdef", ["ab", "bc", "cd", "de", "ec", "af"])
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    edges = {(e.src, e.dst) for e in graph.edges}
    assert all(step in edges for step in zip(cycle, cycle[1:], strict=False))
    assert set(cycle) == {"c", "d", "e"}


def test_find_cycle_on_long_chain_is_iterative() -> None:
    n = 20_000  # deeper than Python's recursion limit
    nodes = [Node(f"n{i}", NodeKind.COMPUTE) for i in range(n)]
    edges = [Edge(f"n{i}", f"n{i + 1}") for i in range(n - 1)]
    chain = Graph((), (), nodes, edges)
    assert find_cycle(chain) is None
    assert len(topological_order(chain) or []) == n
    loop = Graph((), (), nodes, [*edges, Edge(f"n{n - 1}", "n0")])
    assert len(find_cycle(loop) or []) == n + 1


def test_reachable() -> None:
    assert reachable(DIAMOND, ["a"]) == {"a", "b", "c", "d"}
    assert reachable(DIAMOND, ["b"]) == {"b", "d"}
    assert reachable(DIAMOND, ["b", "c"]) == {"b", "c", "d"}
    assert reachable(DIAMOND, []) == set()
    assert reachable(_graph("ab", ["ab", "ba"]), ["b"]) == {"a", "b"}


def test_critical_path() -> None:
    cost = {"a": 1.0, "b": 5.0, "c": 2.0, "d": 1.0}.__getitem__
    assert critical_path(DIAMOND, cost) == (7.0, ["a", "b", "d"])
    cheap_b = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 1.0}.__getitem__
    assert critical_path(DIAMOND, cheap_b) == (4.0, ["a", "c", "d"])


def test_critical_path_disconnected_and_empty() -> None:
    graph = _graph("abc", ["ab"])
    assert critical_path(graph, {"a": 1, "b": 1, "c": 5}.__getitem__) == (5, ["c"])
    assert critical_path(_graph("", []), lambda n: 1.0) == (0.0, [])


def test_critical_path_rejects_cycles() -> None:
    with pytest.raises(ValueError, match="acyclic"):
        critical_path(_graph("ab", ["ab", "ba"]), lambda n: 1.0)
