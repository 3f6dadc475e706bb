"""A sharded graph's buckets, rebuilt once what each ``Sharding`` cuts is known.

``Replicate`` makes a segment's buckets from its whole parameters; once tensor or expert
parallelism has filled in each ``Sharding``'s ``params`` (``shard_modules``), a data-parallel
sharded segment's buckets hold the rank's pieces instead, and an expert-parallel one's split
the replicated weights (synchronised over the whole group) from the experts (over the ranks
that hold the same ones). ``sharded_buckets`` is that rule, in one place: ``shard_modules``
applies it after rewriting the code, and a caller that replays known ``Sharding`` records
without the rewrite (``piper tune``'s cache) applies the same. No torch.
"""

from __future__ import annotations

from collections.abc import Mapping

from piper_directives.replicate import segment_buckets
from piper_ir import Bucket, Graph, SegmentRole, ShardKind


def sharded_buckets(graph: Graph) -> tuple[Bucket, ...]:
    """``graph.buckets`` rebuilt for its shardings (module doc): the expert-parallel rule when
    any sharding is expert-parallel, else the tensor-parallel one."""
    if any(sh.kind is ShardKind.EP for sh in graph.sharding):
        experts = {sh.segment: {p.name for p in sh.params}
                   for sh in graph.sharding if sh.kind is ShardKind.EP and sh.collectives}
        return _expert_buckets(graph, experts)
    return _tensor_parallel_buckets(graph)


def _tensor_parallel_buckets(graph: Graph) -> tuple[Bucket, ...]:
    """The buckets of data x tensor parallel segments rebuilt on the shard's sizes."""
    replication = {r.segment: r for r in graph.replication}
    sharding = {s.segment: s for s in graph.sharding if s.segment in replication}
    if not sharding:
        return graph.buckets
    out = [b for b in graph.buckets if b.segment not in sharding]
    for sid, sh in sharding.items():
        seg = graph.segment_by_id[sid]
        if seg.role is SegmentRole.STAGE:
            out.extend(segment_buckets(seg, replication[sid], sh))
    return _in_segment_order(graph, out)


def _expert_buckets(graph: Graph, experts_of: Mapping[str, set[str]]) -> tuple[Bucket, ...]:
    """Each expert-parallel segment's buckets rebuilt now that its expert parameters are known:
    the replicated weights over the whole group, the experts, when the group is also
    data-parallel, over the ranks that hold the same experts."""
    if not experts_of:
        return graph.buckets
    replication = {r.segment: r for r in graph.replication}
    sharding = {s.segment: s for s in graph.sharding}
    out = [b for b in graph.buckets if b.segment not in experts_of]
    for sid, names in experts_of.items():
        rep = replication.get(sid)
        if rep is None:
            continue
        out.extend(segment_buckets(graph.segment_by_id[sid], rep, sharding[sid], frozenset(names)))
    return _in_segment_order(graph, out)


def _in_segment_order(graph: Graph, buckets: list[Bucket]) -> tuple[Bucket, ...]:
    order = {s.id: i for i, s in enumerate(graph.segments)}
    return tuple(sorted(buckets, key=lambda b: order[b.segment]))
