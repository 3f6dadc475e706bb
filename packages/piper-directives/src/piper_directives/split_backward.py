"""Split backward: turn a chunk's fused backward ``B`` into ``BI`` and ``BW``.

An ``Order`` asks for the split simply by naming the halves: a filter with ``PASS: "BI"``
(backward to inputs) or ``PASS: "BW"`` (backward to weights) selects the ``B`` nodes it would
match if they were already split. ``requested_splits`` collects those nodes from every
``Order`` of a strategy; ``split_backward`` rewrites them. ``Strategy.apply`` runs the two
after ``Place`` and before the ``Order`` directives, so each chunk (segment, microbatch) is
either fused or split, independently of the others.

Requires a placed graph (``docs/ir-conventions.md`` section 3). For each split node
``B.<seg>.mb<i>`` it guarantees nodes ``BI.<seg>.mb<i>`` and ``BW.<seg>.mb<i>`` (same segment,
microbatch, tags, devices and stream) with edges

- every edge into ``B`` (gradients of the outputs, the saved activations ``F -> B``) now
  enters ``BI``: both halves need them, and ``BW`` gets them through ``BI``;
- every gradient ``B`` produced (``grad:<input>`` to the producer or to a ``SEND``) now
  leaves ``BI``, so the pipeline does not wait for the weight gradients;
- ``BI -> BW`` (data, no value: the retained autograd graph);
- every other edge out of ``B`` (``B -> OPT``: the parameter gradients) now leaves ``BW``.

The runtime executes ``BI`` as ``torch.autograd.grad`` towards the segment's inputs with the
graph retained and ``BW`` as the backward towards its parameters: no custom autograd
function in the user's model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

from piper_directives.order import Order, bucket_nodes, candidates
from piper_ir import (
    PASS,
    DirectiveError,
    Edge,
    EdgeKind,
    Filter,
    Graph,
    Node,
    NodeKind,
    Phase,
    backward_halves,
)

_HALVES = (Phase.BI.value, Phase.BW.value)
_MATCHED = frozenset((*_HALVES, Phase.B.value))  # the passes requested_splits looks at


def _names_half(flt: Filter) -> bool:
    """Whether ``_passes(flt)`` holds ``BI`` or ``BW``, without making the set: a schedule
    without split backwards asks this of every filter (132k at 16,384 devices) and nothing
    else."""
    for key, value in flt.items:
        if key == PASS:
            return value in _HALVES or (isinstance(value, tuple) and any(v in _HALVES for v in value))
    return False


def _passes(flt: Filter) -> frozenset[str]:
    """The passes a filter names exactly (one, or a tuple of them; none for ``"*"``). Runs
    once per filter of every Order (132k at 16,384 devices): a loop over the items, not a
    dictionary of them."""
    wanted = None
    for key, value in flt.items:
        if key == PASS:
            wanted = value
            break
    return frozenset(wanted if isinstance(wanted, tuple) else (wanted,))


def requested_splits(graph: Graph, orders: Sequence[Order]) -> dict[str, str]:
    """``B`` node id -> the ``Order`` (as text) that asks for its split.

    Raises ``DirectiveError`` when a chunk is named with one half but not the other, or
    with a half and also as a fused ``B``.
    """
    if not any(_names_half(flt) for order in orders for slot in order.slots for flt in slot):
        return {}  # no Order names a half: nothing to split, nor a chunk named both ways
    wanted = [(order, flt, halves) for order in orders for slot in order.slots for flt in slot
              if (halves := _passes(flt) & _MATCHED)]
    fused = [n for n in graph.nodes if n.kind is NodeKind.COMPUTE and n.phase is Phase.B]
    index = bucket_nodes(fused)
    mentioned: dict[str, dict[str, str]] = {half: {} for half in _MATCHED}
    for order, flt, halves in wanted:
        # Match the B nodes on everything but the pass: the node the filter would select
        # once split.
        probe = Filter((*(item for item in flt.items if item[0] != PASS), (PASS, Phase.B.value)))
        for n in candidates(probe, index, fused):
            if probe.matches(n):
                for half in halves:
                    mentioned[half].setdefault(n.id, str(order))
    bi, bw, b = (mentioned[h] for h in (*_HALVES, Phase.B.value))
    for have, lack, half, other in ((bi, bw, "BI", "BW"), (bw, bi, "BW", "BI")):
        alone = sorted(set(have) - set(lack))
        if alone:
            raise DirectiveError(
                f"{_chunk(graph, alone[0])} is ordered as {half} but no Order places its {other}; "
                "a split backward needs both halves",
                directive=have[alone[0]],
                nodes=alone,
            )
    both = sorted(set(bi) & set(b))
    if both:
        raise DirectiveError(
            f"{_chunk(graph, both[0])} is ordered both as a fused B and as BI/BW; choose one per chunk",
            directive=bi[both[0]],
            nodes=both,
        )
    return bi


def _chunk(graph: Graph, node_id: str) -> str:
    n = graph.node(node_id)
    return f"the backward of segment {n.segment} ({n.tags}) for microbatch {n.microbatch} ({node_id})"


def split_backward(graph: Graph, nodes: Iterable[str] | Mapping[str, str]) -> Graph:
    """Replace each listed ``B`` node by ``BI -> BW`` (see the module docstring)."""
    origins = dict(nodes) if isinstance(nodes, Mapping) else dict.fromkeys(nodes, "split_backward")
    if not origins:
        return graph
    by_id = graph.node_by_id
    halves: dict[str, tuple[str, str]] = {}
    for nid in origins:
        n = by_id.get(nid)
        if n is None or n.kind is not NodeKind.COMPUTE or n.phase is not Phase.B:
            raise DirectiveError(f"{nid} is not a fused backward (B) node; only those can be split", nodes=[nid])
        pair = backward_halves(nid)
        clash = [h for h in pair if h in by_id]
        if clash:
            raise DirectiveError(f"cannot split {nid}: node {clash[0]} already exists", nodes=[nid, clash[0]])
        halves[nid] = pair
    nodes_out: list[Node] = []
    for n in graph.nodes:
        if n.id not in halves:
            nodes_out.append(n)
            continue
        bi, bw = halves[n.id]
        origin = f"split backward, asked for by {origins[n.id]}"
        nodes_out.append(attrs.evolve(n, id=bi, phase=Phase.BI, origin=origin))
        nodes_out.append(attrs.evolve(n, id=bw, phase=Phase.BW, origin=origin))
    edges_out: list[Edge] = []
    for e in graph.edges:
        src, dst = e.src, e.dst
        if dst in halves:
            dst = halves[dst][0]  # gradients in and saved activations feed BI
        if src in halves:
            # Gradients for the producers leave BI; the rest (parameter gradients for the
            # optimizer, anything ordered after the backward) waits for BW.
            gives_grad = e.kind is EdgeKind.DATA and e.value is not None
            src = halves[src][0 if gives_grad else 1]
        edges_out.append(e if (src, dst) == (e.src, e.dst) else attrs.evolve(e, src=src, dst=dst))
    edges_out.extend(Edge(bi, bw) for bi, bw in halves.values())
    return attrs.evolve(graph, nodes=tuple(nodes_out), edges=tuple(edges_out))
