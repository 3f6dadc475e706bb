"""``forward_only``: the evaluation step of a training graph (no backward, no optimizer).

Requires a placed graph (after ``Strategy.apply``, optionally ``plan_memory`` and
``add_grad_norm``; docs/ir-conventions.md sections 1-7, 10). Guarantees (section 11): a
graph with the same segments, values, placement, buckets and sharding whose nodes are the
forward compute (``F`` of every segment, the loss included), the transfers of activations
(``SEND``/``RECV`` of values that are not gradients), the parameter gathers and frees of
buckets whose parameters live sharded (``MATERIALIZE``/``FREE``) and markers. Backward
passes, optimizer steps, gradient transfers, gradient reductions, parameter all-gathers and
the gradient norm are dropped.

Every ordering the training graph implies between two kept nodes on a common device is
kept: a path through dropped nodes becomes a temporal edge (between ranks, the kept
activation transfers order what they must), so a schedule's order of forwards (a 1F1B rank's
forwards, interleaved with backwards in training, stay in that order) and a ZeRO-3 chain's
free after the chain's last kept use survive. ``compile_program`` compiles the result like
any graph, on the same communicators (a subset of the training program's), so a runtime can
run it on the workers of the training program. The pass is pure.
"""

from __future__ import annotations

import attrs

from piper_ir import Edge, EdgeKind, Graph, Node, NodeKind, Phase, is_grad, topological_order, validate

KEPT_KINDS = frozenset({NodeKind.MATERIALIZE, NodeKind.FREE, NodeKind.MARKER})
ORIGIN = "forward_only"


def keeps(node: Node) -> bool:
    """Whether the evaluation step runs ``node``."""
    if node.kind is NodeKind.COMPUTE:
        return node.phase is Phase.F
    if node.kind in (NodeKind.SEND, NodeKind.RECV):
        return not is_grad(node.value or "")
    return node.kind in KEPT_KINDS


def forward_only(graph: Graph) -> Graph:
    """The evaluation step of ``graph`` (module doc)."""
    order = topological_order(graph)
    if order is None:
        return validate(graph)  # reports the cycle
    kept = {n.id for n in graph.nodes if keeps(n)}
    nodes = graph.node_by_id
    # For each node, the kept nodes that reach it through dropped nodes only (its own id for
    # a kept node): a kept node's predecessors' frontiers become its incoming edges.
    frontier: dict[str, frozenset[str]] = {}
    edges: dict[tuple[str, str], Edge] = {}
    for nid in order:
        reach: set[str] = set()
        for e in graph.predecessors[nid]:
            if e.src in kept and nid in kept:
                edges.setdefault((e.src, nid), e)
            else:
                reach |= frontier[e.src]
        if nid in kept:
            here = set(nodes[nid].devices)
            for src in sorted(reach):
                if here.isdisjoint(nodes[src].devices):
                    continue
                edges.setdefault((src, nid), Edge(src, nid, EdgeKind.TEMPORAL, origin=ORIGIN))
            frontier[nid] = frozenset((nid,))
        else:
            frontier[nid] = frozenset(reach)
    return validate(
        attrs.evolve(
            graph,
            nodes=tuple(n for n in graph.nodes if n.id in kept),
            edges=tuple(edges.values()),
            grad_norm=None,
        )
    )
