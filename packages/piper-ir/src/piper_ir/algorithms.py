"""Graph algorithms over node ids: topological order, cycles, reachability, critical path,
and the per-rank order of compute that the scheduler uses (``rank_orders``).

All functions take the graph's edges (data and temporal alike) and never modify the graph.
They are iterative, so they work on graphs with millions of nodes.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable, Iterable

from piper_ir.graph import Graph, Node, NodeKind
from piper_ir.tags import Phase


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


PHASE_ORDER = {Phase.F: 0, Phase.B: 1, Phase.BI: 2, Phase.BW: 3, Phase.OPT: 4}
RANKED_KINDS = frozenset({NodeKind.COMPUTE, NodeKind.OPTIMIZER})


def rank_orders(graph: Graph, listed: Iterable[NodeKind] = ()) -> list[list[str]] | None:
    """Each rank's COMPUTE/OPTIMIZER node ids in the deterministic order the scheduler runs
    them (``None`` when the graph has a cycle); nodes of a kind in ``listed`` are listed too,
    on every device of their group.

    One Kahn pass over the whole graph (all ranks at once, data and temporal edges), so
    cross-rank paths through SEND/RECV are respected. Nodes of other kinds, and of ``listed``
    kinds, are released as soon as they are ready; ready compute nodes leave a heap by
    (phase, microbatch, segment position, graph position). Phase comes first so a graph
    without Order edges runs GPipe-like: all forwards, then all backwards, on each rank.

    Inserting nodes that are released as soon as ready does not change the compute order as
    long as each new node depends only on nodes already ordered: the heap sees the same
    ready compute nodes at every pop (``piper_memory.plan_memory`` relies on this).
    """
    listed = frozenset(listed)
    seg_pos = {s.id: i for i, s in enumerate(graph.segments)}
    indeg = {n.id: 0 for n in graph.nodes}
    for e in graph.edges:
        indeg[e.dst] += 1
    nodes = graph.node_by_id
    succ = graph.successors
    free: deque[str] = deque()
    heap: list[tuple[int, int, int, int, str]] = []

    def release(pos: int, n: Node) -> None:
        if n.kind in RANKED_KINDS:
            key = (
                PHASE_ORDER[n.phase] if n.phase else len(PHASE_ORDER),
                -1 if n.microbatch is None else n.microbatch,
                seg_pos.get(n.segment or "", len(seg_pos)),
                pos,
                n.id,
            )
            heapq.heappush(heap, key)
        else:
            free.append(n.id)

    position = {}
    for i, n in enumerate(graph.nodes):
        position[n.id] = i
        if indeg[n.id] == 0:
            release(i, n)
    orders: list[list[str]] = [[] for _ in range(max(graph.world_size, 0))]
    done = 0
    while free or heap:
        if free:
            nid = free.popleft()
            if nodes[nid].kind in listed:
                for d in nodes[nid].devices:
                    orders[d].append(nid)
        else:
            nid = heapq.heappop(heap)[-1]
            for d in nodes[nid].devices:
                orders[d].append(nid)
        done += 1
        for e in succ[nid]:
            indeg[e.dst] -= 1
            if indeg[e.dst] == 0:
                release(position[e.dst], nodes[e.dst])
    return orders if done == len(indeg) else None
