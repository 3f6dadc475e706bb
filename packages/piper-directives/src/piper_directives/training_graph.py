"""The single-device training DAG of one step, built from segments and values.

Shared by ``capture`` (segments cut from a traced model) and ``synthetic_graph`` (segments
made up without torch), so both produce exactly the graph of docs/ir-conventions.md,
section 1: ``F``/``B`` per segment, ``OPT`` per segment with parameters, data edges for every
value one segment produces and another consumes, and gradient edges for those that need one.
"""

from __future__ import annotations

from collections.abc import Sequence

from piper_ir import Edge, Graph, Node, NodeKind, Phase, Segment, Value, compute_id, grad_name


def training_graph(
    segments: Sequence[Segment], values: Sequence[Value], inputs: Sequence[str], targets: Sequence[str]
) -> Graph:
    meta = {v.name: v.meta for v in values}
    producer = {out: seg.id for seg in segments for out in seg.outputs}
    nodes: list[Node] = []
    edges: list[Edge] = []
    for seg in segments:
        fwd, bwd = compute_id(Phase.F, seg.id), compute_id(Phase.B, seg.id)
        nodes.append(Node(fwd, NodeKind.COMPUTE, seg.id, Phase.F, tags=seg.tags))
        nodes.append(Node(bwd, NodeKind.COMPUTE, seg.id, Phase.B, tags=seg.tags))
        edges.append(Edge(fwd, bwd))
        if seg.params:
            opt = compute_id(Phase.OPT, seg.id)
            nodes.append(Node(opt, NodeKind.OPTIMIZER, seg.id, Phase.OPT, tags=seg.tags))
            edges.append(Edge(bwd, opt))
    for seg in segments:
        for v in dict.fromkeys(seg.inputs):  # a value read twice is one edge
            src = producer.get(v)
            if src is None:
                continue  # a batch value: read from the batch, no producer node
            edges.append(Edge(compute_id(Phase.F, src), compute_id(Phase.F, seg.id), value=v))
            if meta[v].requires_grad:
                edges.append(Edge(compute_id(Phase.B, seg.id), compute_id(Phase.B, src), value=grad_name(v)))
    return Graph(
        segments=tuple(segments),
        values=tuple(values),
        nodes=tuple(nodes),
        edges=tuple(edges),
        inputs=tuple(inputs),
        targets=tuple(targets),
    )
