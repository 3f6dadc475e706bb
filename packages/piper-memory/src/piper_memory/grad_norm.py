"""``add_grad_norm``: the global gradient norm (and clipping by it) as one node of the graph.

Requires a graph after ``plan_memory`` (docs/ir-conventions.md, section 7): the reductions
of every replicated segment are nodes, and ``Bucket`` residency says where each gradient
lives when the optimizer steps. Guarantees (section 10):

- one ``GRAD_NORM`` node ``grad_norm`` on every device of the world (stream ``compute``),
  after every predecessor of every ``OPTIMIZER`` node (weight-gradient passes, reductions,
  mirror sums) and before every ``OPTIMIZER`` node: the scheduler lists it on every rank as
  one collective, the verifier proves it deadlock-free like any other;
- ``Graph.grad_norm``: a ``GradNorm`` with ``max_norm`` and the ``NormTerm``s each rank
  counts, so that every element of the single-device model's gradient is counted exactly
  once over the world.

Which pieces a rank counts, read off the IR (never a ZeRO level):

- a parameter in a bucket whose optimizer state is ``FULL``: after the reduction every
  rank of the bucket's group holds the same full gradient; the group's first rank counts it;
- a bucket whose optimizer state is ``SHARDED``: each rank holds its shard of the reduced
  gradient and counts the elements of it that belong to parameters (not the padding); of a
  mirror family (``Bucket.mirrors``, equal after the mirror sum) only the bucket listed
  first in ``Graph.buckets`` counts;
- a tensor-parallel segment: a parameter that ``Sharding.params`` cuts is a different piece
  on each position, every position counts its own; one that is replicated over the
  tensor-parallel group (LayerNorms, biases added after the all-reduce) has equal gradients
  on every position, and only position 0 counts it (in a per-position bucket: only the
  buckets of position 0);
- a parameter in no bucket: on a single device, that device; an expert-parallel rank's
  experts (cut, one rank each), every rank of the group; a copy replicated over a
  tensor-parallel group, its first rank;
- a tied parameter (``Graph.ties``: one logical parameter held by several segments, whose
  gradient is the sum over the holders and equal on each after it) counts in its first
  holder only.

The pass is pure: a new graph comes back.
"""

from __future__ import annotations

import attrs

from piper_ir import (
    BUCKET_KINDS,
    Bucket,
    Edge,
    EdgeKind,
    GradNorm,
    Graph,
    MemoryPlanError,
    Node,
    NodeKind,
    NormTerm,
    Residency,
    Segment,
    Sharding,
    ShardKind,
    validate,
)

NODE_ID = "grad_norm"
ORIGIN = "add_grad_norm"


def add_grad_norm(graph: Graph, max_norm: float | None = None) -> Graph:
    """``graph`` with the ``GRAD_NORM`` node and its ``GradNorm`` (module doc); ``max_norm``
    clips to that total 2-norm, ``None`` only measures it."""
    if max_norm is not None and not max_norm > 0:
        raise MemoryPlanError(f"the gradient clipping norm must be > 0, got {max_norm!r}")
    if any(n.kind is NodeKind.GRAD_NORM for n in graph.nodes):
        raise MemoryPlanError("the graph already has a gradient norm", nodes=[NODE_ID])
    if graph.buckets and not any(n.kind in BUCKET_KINDS for n in graph.nodes):
        raise MemoryPlanError("the graph has parameter buckets but no reductions: run plan_memory first")
    opts = [n for n in graph.nodes if n.kind is NodeKind.OPTIMIZER]
    if not opts:
        raise MemoryPlanError("the graph has no optimizer step to clip the gradients of")
    node = Node(NODE_ID, NodeKind.GRAD_NORM, devices=tuple(range(graph.world_size)), stream="compute", origin=ORIGIN)
    edges: dict[tuple[str, str], Edge] = {}
    for opt in opts:
        for e in graph.predecessors[opt.id]:
            edges.setdefault((e.src, NODE_ID), Edge(e.src, NODE_ID, EdgeKind.DATA, origin=ORIGIN))
        edges[(NODE_ID, opt.id)] = Edge(NODE_ID, opt.id, EdgeKind.DATA, origin=ORIGIN)
    terms = norm_terms(graph, {n.segment: n.devices for n in opts if n.segment is not None})
    return validate(
        attrs.evolve(
            graph,
            nodes=(*graph.nodes, node),
            edges=(*graph.edges, *edges.values()),
            grad_norm=GradNorm(max_norm, terms),
        )
    )


def norm_terms(graph: Graph, holders: dict[str, tuple[int, ...]]) -> tuple[NormTerm, ...]:
    """Every rank's ``NormTerm``s (module doc); ``holders``: segment id -> the devices that
    hold its parameters (its ``OPTIMIZER`` node's)."""
    sharding = {sh.segment: sh for sh in graph.sharding}
    replication = {r.segment: r for r in graph.replication}
    buckets: dict[str, list[Bucket]] = {}
    for b in graph.buckets:
        buckets.setdefault(b.segment, []).append(b)
    first_of_family = _first_of_families(graph.buckets)
    # The later holders of a tied parameter hold copies of the first's (summed) gradient.
    copies = {holder for tie in graph.ties for holder in tie.holders[1:]}
    terms: list[NormTerm] = []
    for seg in graph.segments:
        if seg.id not in holders or not seg.params:
            continue
        counted = {name for name, _ in seg.params if (seg.id, name) not in copies}
        sh = sharding.get(seg.id)
        cut = {p.name for p in sh.params} if sh is not None else set()
        in_buckets: set[str] = set()
        for b in buckets.get(seg.id, []):
            in_buckets.update(b.params)
            if b.id not in first_of_family:
                continue  # a mirror: equal to its family's first bucket after the mirror sum
            group = b.devices or (replication[seg.id].devices if seg.id in replication else holders[seg.id])
            position0 = sh is None or sh.kind is not ShardKind.TP or not b.devices or sh.position(b.devices[0]) == 0
            wanted = [n for n in b.params if n in counted and (n in cut or position0)]
            terms += _bucket_terms(seg, sh, b, group, wanted)
        for name, _ in seg.params:
            if name in in_buckets or name not in counted:
                continue
            ranks = holders[seg.id] if name in cut else holders[seg.id][:1]
            terms += [NormTerm(r, seg.id, param=name) for r in ranks]
    return tuple(sorted(terms, key=lambda t: t.rank))


def _first_of_families(buckets: tuple[Bucket, ...]) -> set[str]:
    """Bucket ids that count: all but the mirrors of a bucket listed earlier."""
    out: set[str] = set()
    shadowed: set[str] = set()
    for b in buckets:
        if b.id in shadowed:
            continue
        out.add(b.id)
        shadowed.update(b.mirrors)
    return out


def _bucket_terms(
    seg: Segment, sh: Sharding | None, b: Bucket, group: tuple[int, ...], wanted: list[str]
) -> list[NormTerm]:
    if not wanted:
        return []
    if b.optimizer_home is Residency.FULL:
        # Every rank of the group holds the reduced full gradients: the first counts them.
        return [NormTerm(group[0], seg.id, param=name) for name in wanted]
    metas = dict(seg.params)
    spans: list[tuple[int, int]] = []
    at = 0
    for name in b.params:
        meta = sh.local_meta(name, metas[name]) if sh is not None else metas[name]
        if name in wanted:
            spans.append((at, at + meta.numel()))
        at += meta.numel()
    if at != b.numel:
        raise MemoryPlanError(f"bucket {b.id}: its parameters hold {at} elements, the bucket says {b.numel}")
    out = []
    n = b.shard_numel
    for j, rank in enumerate(group):
        lo, hi = j * n, (j + 1) * n
        ranges = _merge([(max(a, lo) - lo, min(c, hi) - lo) for a, c in spans if a < hi and c > lo])
        if ranges:
            out.append(NormTerm(rank, seg.id, bucket=b.id, ranges=ranges))
    return out


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, c in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], c)
        else:
            out.append((a, c))
    return out
