"""``Split``: divide the batch into microbatches (the first phase of ``Strategy.apply``).

Requires a captured graph (``microbatches == 1``). Guarantees: every F/B node is copied per
microbatch (ids ``<id>.mb<i>``), edges are copied per microbatch, each ``OPT`` node waits for
the backward of every microbatch, and value metas are divided along their batch dimension.
The runtime scales each microbatch's loss by ``1/microbatches`` exactly once.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from piper_directives.common import JsonObject, user_location
from piper_ir import DirectiveError, Edge, Graph, Node, NodeKind, Value, microbatch_id


@attrs.frozen
class Split:
    op: ClassVar[str] = "split"

    microbatches: int
    where: str = attrs.field(factory=user_location, eq=False)

    def __str__(self) -> str:
        return f"Split(microbatches={self.microbatches}) at {self.where}"

    def to_json(self) -> JsonObject:
        return {"op": self.op, "microbatches": self.microbatches}

    @classmethod
    def from_json(cls, item: JsonObject, where: str) -> Split:
        return cls(**item, where=where)

    def apply(self, graph: Graph) -> Graph:
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise DirectiveError(f"microbatches must be a positive int, got {m!r}", directive=str(self))
        if graph.microbatches != 1:
            raise DirectiveError(f"the graph is already split into {graph.microbatches} microbatches", directive=str(self))
        if any(n.kind not in (NodeKind.COMPUTE, NodeKind.OPTIMIZER) for n in graph.nodes):
            raise DirectiveError("Split must come before Place (the graph already has communication)", directive=str(self))
        values = []
        for v in graph.values:
            meta = v.meta
            if meta.batch_dim is not None and meta.shape[meta.batch_dim] % m:
                raise DirectiveError(
                    f"value {v.name} has {meta.shape[meta.batch_dim]} samples along its batch dimension, "
                    f"not divisible into {m} microbatches",
                    directive=str(self),
                )
            values.append(Value(v.name, meta.split(m)))
        per_mb = {n.id for n in graph.nodes if n.kind is NodeKind.COMPUTE}
        nodes: list[Node] = []
        for n in graph.nodes:
            if n.id in per_mb:
                nodes.extend(attrs.evolve(n, id=microbatch_id(n.id, i), microbatch=i) for i in range(m))
            else:
                nodes.append(n)
        edges: list[Edge] = []
        for e in graph.edges:
            src_split, dst_split = e.src in per_mb, e.dst in per_mb
            for i in range(m):
                src = microbatch_id(e.src, i) if src_split else e.src
                dst = microbatch_id(e.dst, i) if dst_split else e.dst
                edges.append(attrs.evolve(e, src=src, dst=dst))
                if not (src_split or dst_split):
                    break
        return attrs.evolve(graph, values=tuple(values), nodes=tuple(nodes), edges=tuple(edges), microbatches=m)
