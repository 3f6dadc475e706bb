"""The graph's adjacency by position (``Graph.successor_positions``,
``predecessor_positions``; ``predecessors`` made on demand), the passes that count by it
(``is_acyclic``, ``rank_orders``, ``rank_order_positions``) against their keyed-by-id forms,
and what ``gc_paused`` leaves behind."""

from __future__ import annotations

import gc

import attrs
import pytest

from piper_ir import (
    Edge,
    EdgeKind,
    Graph,
    Node,
    NodeKind,
    Phase,
    gc_paused,
    is_acyclic,
    rank_order_positions,
    rank_orders,
)
from piper_ir.algorithms import MOVE_AT, _rank_orders_by_id


def _pipeline() -> Graph:
    """Two ranks, two microbatches: F then B of two segments, a send/recv pair per
    microbatch and direction, nodes listed out of topological order."""
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
    edges.append(Edge("B.s1.mb0", "F.s1.mb1", EdgeKind.TEMPORAL))  # rank 1: 1F1B
    return Graph((), (), nodes, edges, world_size=2, microbatches=2)


def _doubled() -> Graph:
    """``_pipeline`` with a temporal edge that stands twice (counted twice)."""
    g = _pipeline()
    twice = [Edge("F.s0.mb0", "B.s0.mb0", EdgeKind.TEMPORAL)] * 2
    return attrs.evolve(g, edges=(*g.edges, *twice))


def test_successor_positions_are_the_successors_by_position() -> None:
    g = _pipeline()
    position = {n.id: i for i, n in enumerate(g.nodes)}
    assert g.successor_positions == [[position[e.dst] for e in g.successors[n.id]] for n in g.nodes]
    assert list(g.successors) == list(g.predecessors) == [n.id for n in g.nodes]
    assert sum(map(len, g.predecessors.values())) == len(g.edges)


def test_an_unknown_end_or_a_repeated_id_leaves_no_positions() -> None:
    g = _pipeline()
    unknown = attrs.evolve(g, edges=(*g.edges, Edge("F.s0.mb0", "nowhere")))
    assert unknown.successor_positions is None
    assert list(unknown.predecessors)[-1] == "nowhere" and "nowhere" not in unknown.successors
    assert unknown.successors["F.s0.mb0"][-1].dst == "nowhere"
    twice = attrs.evolve(g, nodes=(*g.nodes, g.nodes[0]))
    assert twice.successor_positions is None and list(twice.successors) == list(g.successors)


def test_rank_orders_by_position_agrees_with_the_keyed_form() -> None:
    g = _pipeline()
    seg_pos: dict[str, int] = {}
    listed = frozenset({NodeKind.SEND})
    assert rank_orders(g, listed) == _rank_orders_by_id(g, listed, seg_pos)
    assert rank_orders(g) == [
        ["F.s0.mb0", "F.s0.mb1", "B.s0.mb0", "B.s0.mb1"],
        ["F.s1.mb0", "B.s1.mb0", "F.s1.mb1", "B.s1.mb1"],
    ]
    cyclic = attrs.evolve(g, edges=(*g.edges, Edge("B.s0.mb1", "F.s0.mb0", EdgeKind.TEMPORAL)))
    assert rank_orders(cyclic) is None and not is_acyclic(cyclic) and is_acyclic(g)


def test_rank_orders_of_microbatches_outside_the_graphs_count() -> None:
    """An unvalidated graph (microbatches outside ``[0, graph.microbatches)``, one below zero,
    an optimizer step of no microbatch) orders as the keyed form does: the position form
    packs each heap key into one integer by the microbatches' span, and widens that span
    to the microbatches it finds."""
    g = _pipeline()
    steps = [Node(f"opt.s{r}", NodeKind.OPTIMIZER, f"s{r}", devices=(r,)) for r in (0, 1)]
    shifted = attrs.evolve(
        g,
        nodes=[*(attrs.evolve(n, microbatch=n.microbatch - 1) if n.microbatch is not None else n for n in g.nodes),
               *steps],
        edges=[*g.edges, *(Edge(f"B.s{r}.mb1", f"opt.s{r}") for r in (0, 1))],
    )
    for graph in (attrs.evolve(g, microbatches=1), shifted):
        for listed in (frozenset(), frozenset({NodeKind.SEND, NodeKind.RECV})):
            assert rank_orders(graph, listed) == _rank_orders_by_id(graph, listed, {})
    # the optimizer step (no microbatch) sorts before the compute nodes in the heap, but
    # waits for its last backward
    assert rank_orders(shifted)[0][-1] == "opt.s0"


def test_ready_compute_nodes_leave_by_phase_then_microbatch_whatever_the_count() -> None:
    """All ready at once (no edges), so the heap alone decides: forwards before backwards,
    each by microbatch, also where the graph's microbatch count is wrong or a microbatch is
    negative."""
    numbers = (3, -2, 0, 1)
    nodes = [Node(f"{p.value}{mb}", NodeKind.COMPUTE, "s", p, mb, devices=(0,)) for mb in numbers for p in (Phase.B, Phase.F)]
    g = Graph((), (), nodes, (), world_size=1, microbatches=1)
    expected = [f"{p.value}{mb}" for p in (Phase.F, Phase.B) for mb in sorted(numbers)]
    assert rank_orders(g) == [expected] == _rank_orders_by_id(g, frozenset(), {})


def test_cycle_checks_without_positions() -> None:
    g = _pipeline()
    twice = attrs.evolve(g, nodes=(*g.nodes, g.nodes[0]))
    assert twice.successor_positions is None and is_acyclic(twice)
    looped = attrs.evolve(twice, edges=(*g.edges, Edge("B.s0.mb1", "F.s0.mb0", EdgeKind.TEMPORAL)))
    assert not is_acyclic(looped) and rank_orders(looped) is None


def test_gc_paused_moves_what_the_pass_kept_to_the_oldest_generation() -> None:
    """Without the move, the 50k containers made in the pause are the young generation the
    first allocation after it collects (walking every one of them)."""
    assert gc.isenabled()
    gc.collect()
    runs: list[int] = []
    gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
    try:
        with gc_paused():
            kept = [[i] for i in range(50_000)]  # tracked containers
        after = [[i] for i in range(10)]
        assert runs == [] and gc.get_count()[1] == 0, (runs, gc.get_count())
        assert gc.is_tracked(kept[0]) and len(after) == 10
    finally:
        gc.callbacks.pop()
    del kept


def test_gc_paused_leaves_objects_frozen_by_the_process_alone() -> None:
    """A process that froze objects (``gc.freeze`` before a fork) keeps them frozen: the
    pause then leaves the young generation to the collector as it was."""
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            made = [[i] for i in range(1_000)]
        assert gc.get_freeze_count() == frozen and len(made) == 1_000
    finally:
        gc.unfreeze()
        gc.collect()


def test_a_small_pause_never_counts_the_frozen_objects(monkeypatch) -> None:
    """Counting frozen objects walks them all: a pass that made few containers skips the move
    without asking, one that made many asks once."""
    asked: list[int] = []
    real = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: asked.append(1) or real())
    gc.collect()
    with gc_paused():
        small = [[i] for i in range(100)]
    assert asked == [] and len(small) == 100
    with gc_paused():
        large = [[i] for i in range(2 * MOVE_AT)]
    assert asked == [1] and len(large) == 2 * MOVE_AT


def test_predecessor_positions_are_the_predecessors_by_position() -> None:
    g = _doubled()
    position = {n.id: i for i, n in enumerate(g.nodes)}
    keyed: dict[str, list[Edge]] = {n.id: [] for n in g.nodes}
    for e in g.edges:
        keyed[e.dst].append(e)
    assert g.predecessor_positions == [[position[e.src] for e in keyed[n.id]] for n in g.nodes]
    assert g.predecessors == keyed  # made on demand, from the edges, in edge order
    assert sum(map(len, g.predecessor_positions)) == len(g.edges)


def test_no_positions_without_known_ends() -> None:
    g = _doubled()
    unknown = attrs.evolve(g, edges=(*g.edges, Edge("F.s0.mb0", "nowhere")))
    assert unknown.successor_positions is None and unknown.predecessor_positions is None
    assert list(unknown.predecessors)[-1] == "nowhere"
    with pytest.raises(ValueError, match="unique"):
        rank_order_positions(unknown)


def test_rank_order_positions_are_rank_orders_by_position() -> None:
    g = _doubled()
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
