"""Graph algorithms over node ids: topological order, cycles, reachability, critical path.

All functions take the graph's edges (data and temporal alike) and never modify the graph.
They are iterative, so they work on graphs with millions of nodes.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable, Iterable

from piper_ir.graph import Graph


def _adjacency(graph: Graph) -> tuple[dict[str, list[str]], dict[str, int]]:
    succ: dict[str, list[str]] = {n.id: [] for n in graph.nodes}
    indeg: dict[str, int] = {n.id: 0 for n in graph.nodes}
    for e in graph.edges:
        succ[e.src].append(e.dst)
        indeg[e.dst] += 1
    return succ, indeg


def topological_order(
    graph: Graph, key: Callable[[str], Hashable] | None = None
) -> list[str] | None:
    """Kahn's algorithm; ``None`` when the graph has a cycle.

    With ``key``, ties among ready nodes are broken by smallest key (deterministic); without
    it, by the order of ``graph.nodes``.
    """
    succ, indeg = _adjacency(graph)
    position = {n.id: i for i, n in enumerate(graph.nodes)}
    sort_key = key or position.__getitem__
    ready = [(sort_key(n), position[n], n) for n, d in indeg.items() if d == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, _, node = heapq.heappop(ready)
        order.append(node)
        for nxt in succ[node]:
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                heapq.heappush(ready, (sort_key(nxt), position[nxt], nxt))
    return order if len(order) == len(indeg) else None


def find_cycle(graph: Graph) -> list[str] | None:
    """Return one cycle as a list of node ids (first == last), or ``None``."""
    succ, _ = _adjacency(graph)
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(succ, white)
    parent: dict[str, str] = {}
    for root in succ:
        if color[root] != white:
            continue
        stack: list[tuple[str, Iterable[str]]] = [(root, iter(succ[root]))]
        color[root] = grey
        while stack:
            node, children = stack[-1]
            advanced = False
            for child in children:
                if color[child] == white:
                    color[child] = grey
                    parent[child] = node
                    stack.append((child, iter(succ[child])))
                    advanced = True
                    break
                if color[child] == grey:
                    cycle = [child, node]
                    cur = node
                    while cur != child:
                        cur = parent[cur]
                        cycle.append(cur)
                    cycle.reverse()
                    return cycle
            if not advanced:
                color[node] = black
                stack.pop()
    return None


def reachable(graph: Graph, sources: Iterable[str]) -> set[str]:
    """Every node reachable from ``sources`` (the sources included)."""
    succ, _ = _adjacency(graph)
    seen = set(sources)
    queue = deque(seen)
    while queue:
        node = queue.popleft()
        for nxt in succ[node]:
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def critical_path(graph: Graph, cost: Callable[[str], float]) -> tuple[float, list[str]]:
    """Longest path by node cost: (length, node ids along it)."""
    order = topological_order(graph)
    if order is None:
        raise ValueError("critical_path needs an acyclic graph")
    preds: dict[str, list[str]] = {n.id: [] for n in graph.nodes}
    for e in graph.edges:
        preds[e.dst].append(e.src)
    best: dict[str, float] = {}
    via: dict[str, str | None] = {}
    for node in order:
        start, came = 0.0, None
        for p in preds[node]:
            if best[p] > start:
                start, came = best[p], p
        best[node] = start + cost(node)
        via[node] = came
    if not best:
        return 0.0, []
    end = max(best, key=best.__getitem__)
    path = [end]
    while via[path[-1]] is not None:
        path.append(via[path[-1]])  # type: ignore[arg-type]
    path.reverse()
    return best[end], path
