"""Graph algorithms over node ids: topological order, cycles, reachability, critical path,
and the per-rank order of compute that the scheduler uses (``rank_orders``).

All functions take the graph's edges (data and temporal alike) and never modify the graph.
They are iterative, so they work on graphs with millions of nodes. Those that walk the whole
graph use its cached adjacency, so the passes of one compile (``validate``, ``rank_orders``,
the scheduler's stages) build it once; the two that count in-degrees over all of it
(``is_acyclic``, ``rank_orders``) count in lists by node position
(``Graph.successor_positions``), not in tables keyed by id, whenever the graph has them.
"""

from __future__ import annotations

import gc
import heapq
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager

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


def is_acyclic(graph: Graph) -> bool:
    """Whether data and temporal edges together have no cycle (Kahn's algorithm: cheaper
    than ``find_cycle``'s depth-first search, which only a cyclic graph needs)."""
    positions = graph.successor_positions
    if positions is not None:  # by position in ``graph.nodes``: lists, not tables keyed by id
        count = [len(starts) for starts in graph.predecessor_positions]  # type: ignore[union-attr]
        free = [i for i, d in enumerate(count) if not d]
        for i in free:  # ``free`` grows while it is walked: a FIFO without pops
            for j in positions[i]:
                d = count[j] - 1
                count[j] = d
                if not d:
                    free.append(j)
        return len(free) == len(count)
    succ = graph.successors
    indeg = {nid: len(edges) for nid, edges in graph.predecessors.items()}
    ready = [nid for nid, d in indeg.items() if not d]
    for nid in ready:  # ``ready`` grows while it is walked: a FIFO without pops
        for e in succ[nid]:
            d = indeg[e.dst] - 1
            indeg[e.dst] = d
            if not d:
                ready.append(e.dst)
    return len(ready) == len(indeg)


def find_cycle(graph: Graph) -> list[str] | None:
    """Return one cycle as a list of node ids (first == last), or ``None``."""
    if is_acyclic(graph):
        return None
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
    if graph.successor_positions is None:  # an id twice or an edge to an unknown node: keyed by id
        return _rank_orders_by_id(graph, listed, {s.id: i for i, s in enumerate(graph.segments)})
    orders = rank_order_positions(graph, listed)
    if orders is None:
        return None
    nodes = graph.nodes
    return [[nodes[i].id for i in order] for order in orders]


def rank_order_positions(graph: Graph, listed: Iterable[NodeKind] = ()) -> list[list[int]] | None:
    """``rank_orders`` by position in ``graph.nodes``, for a graph with
    ``successor_positions`` (its ids unique, its edges' ends known: a validated graph);
    ``compile_program`` walks the graph by these positions, not by id."""
    listed = frozenset(listed)
    seg_pos = {s.id: i for i, s in enumerate(graph.segments)}
    positions = graph.successor_positions
    if positions is None:
        raise ValueError("rank_order_positions needs a graph whose ids are unique and whose edges name its nodes")
    nodes = graph.nodes
    # Per node (by position), what its release needs, made once in graph order, so the
    # release loop below, which visits nodes in no such order, reads two lists and never a
    # node (``_release_keys``).
    shift = max(len(nodes), 1).bit_length()
    low = (1 << shift) - 1
    made = _release_keys(nodes, listed, seg_pos, shift, 0, graph.microbatches)
    if made is None:  # a microbatch outside [0, graph.microbatches): an unvalidated graph
        numbers = [n.microbatch for n in nodes if n.microbatch is not None] or [0]
        made = _release_keys(nodes, listed, seg_pos, shift, min(numbers), max(numbers) + 1)
    keys, emit = made  # type: ignore[misc]
    indeg = [len(starts) for starts in graph.predecessor_positions]  # type: ignore[union-attr]
    free: deque[int] = deque(i for i, d in enumerate(indeg) if not d and keys[i] < 0)
    heap = [key for key, d in zip(keys, indeg, strict=True) if not d and key >= 0]
    heapq.heapify(heap)  # the order pushes would give: keys are unique
    push, pop, to_free = heapq.heappush, heapq.heappop, free.append
    orders: list[list[int]] = [[] for _ in range(max(graph.world_size, 0))]
    done = 0
    while free or heap:
        i = free.popleft() if free else pop(heap) & low
        for d in emit[i]:
            orders[d].append(i)
        done += 1
        for j in positions[i]:
            k = indeg[j] - 1
            indeg[j] = k
            if not k:
                key = keys[j]
                if key < 0:
                    to_free(j)
                else:
                    push(heap, key)
    return orders if done == len(indeg) else None


def _release_keys(
    nodes: Sequence[Node], listed: frozenset[NodeKind], seg_pos: dict[str, int], shift: int, first_mb: int, end_mb: int
) -> tuple[list[int], list[tuple[int, ...]]] | None:
    """For ``rank_order_positions``, per node: a compute or optimizer node's heap key as one
    integer (phase, microbatch, segment position, graph position, most significant first: an
    integer compares in one step, a tuple element by element), -1 for any other node (it is
    released as soon as it is ready); and the devices whose orders list the node (none for an
    unlisted other node). ``None`` when a microbatch lies outside ``[first_mb, end_mb)``."""
    no_seg, no_phase = len(seg_pos), len(PHASE_ORDER)
    mb_span, seg_span = end_mb - first_mb + 1, no_seg + 1  # a microbatch of None sorts first
    keys: list[int] = []
    emit: list[tuple[int, ...]] = []
    add_key, add_emit = keys.append, emit.append
    for i, n in enumerate(nodes):
        if n.kind in RANKED_KINDS:
            mb = n.microbatch
            if mb is None:
                mb = 0
            elif first_mb <= mb < end_mb:
                mb += 1 - first_mb
            else:
                return None
            phase = PHASE_ORDER[n.phase] if n.phase else no_phase
            add_key((((phase * mb_span + mb) * seg_span + seg_pos.get(n.segment or "", no_seg)) << shift) | i)
            add_emit(n.devices)
        else:
            add_key(-1)
            add_emit(n.devices if n.kind in listed else ())
    return keys, emit


def _rank_orders_by_id(graph: Graph, listed: frozenset[NodeKind], seg_pos: dict[str, int]) -> list[list[str]] | None:
    """``rank_orders`` of a graph without ``successor_positions`` (two nodes share an id, or
    an edge names an unknown node), keyed by id as the rest of the graph's tables are."""
    no_seg, no_phase = len(seg_pos), len(PHASE_ORDER)
    keys: dict[str, tuple[int, int, int, int, Node]] = {}
    for i, n in enumerate(graph.nodes):
        if n.kind in RANKED_KINDS:
            keys[n.id] = (
                PHASE_ORDER[n.phase] if n.phase else no_phase,
                -1 if n.microbatch is None else n.microbatch,
                seg_pos.get(n.segment or "", no_seg),
                i,
                n,
            )
    nodes = graph.node_by_id
    succ = graph.successors
    indeg = {nid: len(edges) for nid, edges in graph.predecessors.items()}
    free: deque[Node] = deque()
    heap: list[tuple[int, int, int, int, Node]] = []
    push, pop = heapq.heappush, heapq.heappop
    for n in graph.nodes:
        if not indeg[n.id]:
            key = keys.get(n.id)
            if key is None:
                free.append(n)
            else:
                push(heap, key)
    orders: list[list[str]] = [[] for _ in range(max(graph.world_size, 0))]
    done = 0
    while free or heap:
        if free:
            n = free.popleft()
            if n.kind in listed:
                for d in n.devices:
                    orders[d].append(n.id)
        else:
            n = pop(heap)[-1]
            for d in n.devices:
                orders[d].append(n.id)
        done += 1
        for e in succ[n.id]:
            k = indeg[e.dst] - 1
            indeg[e.dst] = k
            if not k:
                key = keys.get(e.dst)
                if key is None:
                    free.append(nodes[e.dst])
                else:
                    push(heap, key)
    return orders if done == len(indeg) else None


#: The containers a paused pass must have made (net, ``gc.get_count()[0]``) for ``gc_paused`` to
#: move them to the oldest generation: below it the collector's walk of them costs little.
MOVE_AT = 20_000


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a pass over a large graph (a context
    manager, or a decorator: ``@gc_paused()``).

    A pass allocates objects in proportion to the graph, and the full collections those
    allocations trigger each walk every live object, the input graph included: at 392k nodes
    that was a third of a compile, and its share grew with the graph. The passes build no
    reference cycles, so reference counting still frees all they drop (a cycle made meanwhile
    is collected later). The collector's state before is restored, so nesting is fine; it is
    process-wide, so another thread allocating meanwhile runs without it too.

    On leaving, what the pass kept (a graph, a program) moves straight to the oldest
    generation, as a collection would move it after finding it alive (``gc.freeze`` then
    ``gc.unfreeze``: two list splices; a cycle made meanwhile waits for the next full
    collection). Otherwise the first collection after the pause walks every object the pass
    made, and the next walks them again: 0.2 s after a compile at 16,384 devices. Skipped while the process keeps objects frozen of its own (``gc.freeze``
    before a fork): unfreezing would hand those back to the collector. Skipped too after a pass
    that made fewer than ``MOVE_AT`` containers, without asking whether any are frozen: that
    question walks every frozen object (``gc.get_freeze_count`` counts a list), which a process
    that froze its imports (a Ray worker: ``RankWorker``) pays at every one of its many small
    passes (a test session's property run took 20 s instead of 4-7 s that way).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_count()[0] >= MOVE_AT and not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
