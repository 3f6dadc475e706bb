"""``Replicate``: data parallelism and ZeRO over the device group a ``Place`` made.

``Replicate(filter, devices, zero=0..3, bucket_mb=25)`` says how the replicas of the matched
regions stay in sync (docs/ir-conventions.md, section 7). ``devices`` must be the group the
regions are placed on; the group's size N is the data-parallel degree.

``replicate_all(graph, replicates)`` is the Replicate phase of ``Strategy.apply``: after
Place and Shard (which groups are tensor-parallel decides what is replicated and how the
batch is cut), before communication is inserted. Requires a placed graph. Guarantees:

- one ``Replication`` per segment placed on several devices (``Graph.replication``): the
  matching ``Replicate``'s settings, else ``Replication(zero=0)`` with default buckets;
- ``Graph.buckets``: each replicated segment's parameters, in ``Segment.params`` order, cut
  into buckets of at most ``bucket_bytes`` (a parameter larger than that is a bucket alone;
  a dtype change starts a new bucket), ids ``bucket:<segment>:<k>``, ``shards = N`` for
  zero >= 1, else 1; a segment that is also tensor- or expert-sharded over groups smaller
  than its device group gets per-position buckets on the ranks holding each shard
  (``segment_buckets``; sections 8-9), refined torch-side once the cut is known;
- every value with a batch dimension describes one shard of one microbatch: its meta is
  divided by N, the size of the group each microbatch runs on, or by N / degree for data x
  tensor parallelism (ranks of one tensor-parallel group share a shard)
  (``TensorMeta.split``); a batch that does not divide evenly is refused. A segment whose
  microbatches run on different groups (DualPipe's mirrored replicas) is replicated over
  their union, which is not sharded further: its replicas sum gradients of different
  microbatches. With zero 0/1 its buckets span the union (``shards`` = its size for zero 1);
  with zero 2/3 each microbatch group shards them over its own ranks (``mirrored_buckets``:
  ``bucket:<seg>:d<g>:<k>`` with ``mirrors``), which needs groups of two or more devices
  and no tensor or expert sharding (both refused).

The gradient reductions, gathers and frees themselves are inserted later, by
``piper_memory.plan_memory``, once the compute order is fixed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import attrs

from piper_directives.common import (
    JsonObject,
    devices_from_json,
    filter_from_json,
    to_devices,
    to_filter,
    user_location,
)
from piper_directives.groups import placement_groups, segments_on_group
from piper_ir import (
    Bucket,
    DirectiveError,
    Filter,
    Graph,
    NodeKind,
    Replication,
    Segment,
    SegmentRole,
    Sharding,
    ShardKind,
    Value,
)

ZERO_LEVELS = (0, 1, 2, 3)
DEFAULT_BUCKET_MB = 25.0

@attrs.frozen
class Replicate:
    """Keep the replicas of the regions matched by ``filter`` (placed on ``devices``) in sync.

    ``zero``: 0 all-reduces gradients once per step per bucket; 1 also shards optimizer state;
    2 also keeps gradients sharded between microbatches; 3 also shards parameters and
    materializes them per chain of uses. ``bucket_mb`` caps a bucket (MiB); reductions run on
    ``reduce_stream``, parameter gathers on ``gather_stream``.
    """

    op: ClassVar[str] = "replicate"

    filter: Filter = attrs.field(converter=to_filter)
    devices: tuple[int, ...] = attrs.field(converter=to_devices)
    zero: int = 0
    bucket_mb: float = DEFAULT_BUCKET_MB
    reduce_stream: str = "dp"
    gather_stream: str = "dp"
    where: str = attrs.field(factory=user_location, eq=False)

    def __attrs_post_init__(self) -> None:
        # Checked at construction: a wrong level or size is wrong whatever graph it meets.
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or self.zero not in ZERO_LEVELS:
            raise DirectiveError(f"zero must be one of 0, 1, 2, 3, got {self.zero!r}", directive=str(self))
        if (
            isinstance(self.bucket_mb, bool)
            or not isinstance(self.bucket_mb, int | float)
            or not math.isfinite(self.bucket_mb)
            or self.bucket_mb <= 0
        ):
            raise DirectiveError(f"bucket_mb must be a positive number, got {self.bucket_mb!r}", directive=str(self))
        for name in ("reduce_stream", "gather_stream"):
            stream = getattr(self, name)
            if not isinstance(stream, str) or not stream or stream == "compute":
                raise DirectiveError(
                    f"{name} must name a stream other than 'compute', got {stream!r}", directive=str(self)
                )

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))

    def __str__(self) -> str:
        return (
            f"Replicate({self.filter}, devices={list(self.devices)}, zero={self.zero!r}, "
            f"bucket_mb={self.bucket_mb!r}) at {self.where}"
        )

    def to_json(self) -> JsonObject:
        return {"op": self.op, "filter": self.filter.as_dict(), "devices": list(self.devices), "zero": self.zero,
                "bucket_mb": self.bucket_mb, "reduce_stream": self.reduce_stream, "gather_stream": self.gather_stream}

    @classmethod
    def from_json(cls, item: JsonObject, where: str) -> Replicate:
        return cls(**{**item, "filter": filter_from_json(item["filter"], where),
                      "devices": devices_from_json(item["devices"], where)}, where=where)


def replicate_all(graph: Graph, replicates: Sequence[Replicate]) -> Graph:
    """Record ``Graph.replication`` and ``Graph.buckets`` and shard the batch (module doc)."""
    group = placement_groups(graph)
    chosen: dict[str, Replicate] = {}
    for rep in replicates:
        if len(rep.devices) < 2:
            raise DirectiveError(
                f"Replicate needs a device group of at least two devices, got {list(rep.devices)}",
                directive=str(rep),
            )
        for seg in segments_on_group(graph, rep, group):
            earlier = chosen.get(seg.id)
            if earlier is not None and _settings(earlier) != _settings(rep):
                raise DirectiveError(
                    f"segment {seg.id} ({seg.tags}) is replicated twice with different settings: "
                    f"by {earlier} and by this directive",
                    directive=str(rep),
                )
            chosen[seg.id] = rep
    replication: list[Replication] = []
    buckets: list[Bucket] = []
    mb_groups: dict[str, list[tuple[int, ...]]] | None = None  # made when a replicated stage needs it
    sharding = {s.segment: s for s in graph.sharding}
    for seg in graph.segments:
        devices = group.get(seg.id, ())
        sh = sharding.get(seg.id)
        # A tensor-parallel group without replicas has nothing to keep in sync.
        if len(devices) < 2 or (sh is not None and sh.kind is ShardKind.TP and sh.degree == len(devices)):
            continue
        rep = chosen.get(seg.id)
        record = (
            Replication(seg.id, devices)
            if rep is None
            else Replication(seg.id, devices, rep.zero, rep.bucket_bytes, rep.reduce_stream, rep.gather_stream, str(rep))
        )
        replication.append(record)
        if seg.role is not SegmentRole.STAGE:
            continue
        if mb_groups is None:  # a pass over every node: a graph with no replicas never needs it
            mb_groups = microbatch_groups(graph)
        runs_on = mb_groups.get(seg.id, [])
        if len(runs_on) > 1 and record.zero >= 2:
            _check_mirrored_zero(seg, record, runs_on, sh, rep)
            buckets.extend(mirrored_buckets(seg, record, runs_on))
        else:
            # What is cut is known once the code is (shard_code / expert_code rebuild these).
            buckets.extend(segment_buckets(seg, record, sh))
    if not replication:
        return graph
    # The batch is sharded over the group each microbatch runs on (place_all checked every
    # multi-device group has one size); ranks of one tensor-parallel group see the same data,
    # so the batch is cut among the groups (shard_all checked one degree). Mirrored replicas
    # (a segment whose microbatches run on different groups, as in DualPipe) are not batch
    # shards: they process different microbatches, so their group can be larger.
    replicated = {r.segment for r in replication}
    group = max(len(n.devices) for n in graph.nodes if n.kind is NodeKind.COMPUTE and n.segment in replicated)
    sh = sharding.get(replication[0].segment)
    replicas = group // (sh.degree if sh is not None and sh.kind is ShardKind.TP else 1)
    return attrs.evolve(
        graph,
        values=_shard_values(graph, replicas, replicates),
        replication=tuple(replication),
        buckets=tuple(buckets),
    )


def segment_buckets(
    seg: Segment, rep: Replication, sharding: Sharding | None = None, cut: frozenset[str] = frozenset()
) -> list[Bucket]:
    """The buckets of replicated segment ``seg``. Without ``sharding``: its parameters over
    the whole group. With a ``Sharding`` of ``degree < len(devices)`` (data x tensor or data x
    expert parallelism), a parameter is reduced among its data-parallel replicas only: the
    ranks that hold the same copy and compute on different data. Those are the ranks at one
    position of every shard group (``Sharding.holders``) for every parameter of a ``tp``
    segment (a tensor-parallel group is one replica) and for the parameters in ``cut`` of an
    ``ep`` segment (the experts); such buckets come per position, ``bucket:<seg>:<kind><t>:<k>``
    on ``devices=holders(t)``, with the shard's sizes (``Sharding.local_meta``). An ``ep``
    segment's other parameters are data-parallel over the whole group; its ``cut`` ones, when
    ``degree == len(devices)``, live on one rank each and get no bucket. The experts of a
    tensor- and expert-parallel segment (``ParamShard.experts``) are an ``ep`` segment's
    ``cut`` ones over its ``expert_degree`` ranks: ``bucket:<seg>:ep<e>:<k>`` on
    ``holders(e, expert_degree)``, none when that group is all of ``devices``."""
    def shards(n: int) -> int:
        return n if rep.zero >= 1 else 1

    if sharding is None:
        return make_buckets(seg, rep.bucket_bytes, shards(len(rep.devices)))
    experts = {p.name for p in sharding.params if p.experts}
    per_position = set(cut) if sharding.kind is ShardKind.EP else {name for name, _ in seg.params} - experts
    out: list[Bucket] = []
    if experts and sharding.expert_degree < len(sharding.devices):
        local = attrs.evolve(
            seg, params=tuple((n, sharding.local_meta(n, m)) for n, m in seg.params if n in experts)
        )
        for e in range(sharding.expert_degree):
            holders = sharding.holders(e, sharding.expert_degree)
            out += make_buckets(local, rep.bucket_bytes, shards(len(holders)), f"ep{e}", holders)
    if sharding.kind is ShardKind.EP:
        whole = attrs.evolve(seg, params=tuple((n, m) for n, m in seg.params if n not in cut))
        out += make_buckets(whole, rep.bucket_bytes, shards(len(rep.devices)))
    if sharding.degree < len(sharding.devices):
        local = attrs.evolve(
            seg, params=tuple((n, sharding.local_meta(n, m)) for n, m in seg.params if n in per_position)
        )
        for t in range(sharding.degree):
            holders = sharding.holders(t)
            out += make_buckets(local, rep.bucket_bytes, shards(len(holders)), f"{sharding.kind}{t}", holders)
    return out


def microbatch_groups(graph: Graph) -> dict[str, list[tuple[int, ...]]]:
    """Segment id -> the distinct device groups its microbatches' compute runs on, in order
    of the first microbatch on each: one group, or several for mirrored replicas (DualPipe:
    direction 0's group, then direction 1's)."""
    first: dict[str, dict[tuple[int, ...], int]] = {}
    for n in graph.nodes:
        if n.kind is NodeKind.COMPUTE and n.segment is not None and n.devices:
            mb = -1 if n.microbatch is None else n.microbatch
            seen = first.setdefault(n.segment, {})
            seen[n.devices] = min(mb, seen.get(n.devices, mb))
    return {seg: sorted(groups, key=groups.__getitem__) for seg, groups in first.items()}


def mirrored_buckets(seg: Segment, rep: Replication, groups: Sequence[tuple[int, ...]]) -> list[Bucket]:
    """ZeRO-2/3 buckets of a segment with mirrored replicas (its microbatches run on several
    ``groups`` of one size N): each group shards ``seg``'s parameters over its own N ranks,
    ``bucket:<seg>:d<g>:<k>`` on ``devices=groups[g]``, ``shards = N``, and names the buckets
    of the other groups with the same layout (index ``k``) as its ``mirrors``: the ranks at one
    position of every group hold the same shard range and sum its gradient before the step
    (``piper_memory.plan_memory``)."""
    per_group = [make_buckets(seg, rep.bucket_bytes, len(g), f"d{i}", g) for i, g in enumerate(groups)]
    return [
        attrs.evolve(b, mirrors=tuple(other[k].id for j, other in enumerate(per_group) if j != i))
        for i, own in enumerate(per_group)
        for k, b in enumerate(own)
    ]


def _check_mirrored_zero(
    seg: Segment, rep: Replication, groups: list[tuple[int, ...]], sh: Sharding | None, directive: Replicate | None
) -> None:
    where = str(directive) if directive is not None else None
    if sh is not None:
        raise DirectiveError(
            f"segment {seg.id} ({seg.tags}) has mirrored replicas (its microbatches run on {list(map(list, groups))}) "
            f"and is {sh.kind}-sharded: ZeRO-{rep.zero} on such a segment is not supported; use zero 0 or 1",
            directive=where,
        )
    if any(len(g) < 2 for g in groups):
        raise DirectiveError(
            f"segment {seg.id} ({seg.tags}) has mirrored replicas that run different microbatches on "
            f"{list(map(list, groups))}: ZeRO-{rep.zero} shards over each group's data-parallel replicas, "
            "which needs groups of at least two devices (more data-parallel replicas, or zero 0 or 1)",
            directive=where,
        )


def make_buckets(
    seg: Segment, bucket_bytes: int, shards: int, tag: str = "", devices: tuple[int, ...] = ()
) -> list[Bucket]:
    """``seg``'s parameters in order, cut into buckets of at most ``bucket_bytes``; ids
    ``bucket:<seg>:<k>`` (``bucket:<seg>:<tag>:<k>`` with a ``tag``), reduced over
    ``devices`` (empty: the segment's whole group)."""
    out: list[Bucket] = []
    names: list[str] = []
    numel = nbytes = 0
    dtype: str | None = None
    prefix = f"bucket:{seg.id}:{tag + ':' if tag else ''}"

    def close() -> None:
        if names:
            out.append(
                Bucket(f"{prefix}{len(out)}", seg.id, tuple(names), numel, shards, dtype or "float32", devices)
            )

    for name, meta in seg.params:
        size = meta.nbytes()
        if names and (meta.dtype != dtype or nbytes + size > bucket_bytes):
            close()
            names, numel, nbytes = [], 0, 0
        names.append(name)
        numel += meta.numel()
        nbytes += size
        dtype = meta.dtype
    close()
    return out


def _settings(rep: Replicate) -> tuple:
    return (rep.zero, rep.bucket_bytes, rep.reduce_stream, rep.gather_stream)


def _shard_values(graph: Graph, replicas: int, replicates: Sequence[Replicate]) -> tuple[Value, ...]:
    values = []
    for v in graph.values:
        meta = v.meta
        if meta.batch_dim is not None and meta.shape[meta.batch_dim] % replicas:
            raise DirectiveError(
                f"value {v.name} has {meta.shape[meta.batch_dim]} samples per microbatch along its batch "
                f"dimension, not divisible among {replicas} data-parallel replicas",
                directive=str(replicates[0]) if replicates else None,
            )
        values.append(Value(v.name, meta.split(replicas)))
    return tuple(values)
