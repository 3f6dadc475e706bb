"""Tied parameters as buckets: where each copy lives and over which ranks its gradient is summed.

A ``Tie`` (``Graph.ties``) is one logical parameter held by several segments: every rank
holding a holder keeps a copy, the gradient of each copy must be the sum of every holder's
gradient once per step, and every copy must take the same update (docs/ir-conventions.md,
section 12). ``tie_units`` works out, from the placement, where the copies are; ``plan_memory``
turns the result into buckets and collectives like any other.

Per tie and *family* (every rank of a segment's group, or for a tensor-parallel segment the
ranks at one position of its tensor-parallel groups, ``Sharding.holders``: the ranks of one
tensor-parallel group compute the same gradient, so it is summed once per group), each
holder sits on the devices of that family. Holders on the same devices form one *unit*: on
each of those ranks they share one tensor (the runtime aliases them), owned by the unit's
first holder in segment order, whose optimizer steps it. Units of one family are disjoint and
of one size N, and their holders share one ZeRO level:

- a family of one unit on one device needs nothing: the holders' passes accumulate into one
  tensor and the owner steps it after all of them (temporal edges);
- otherwise each unit gets a bucket of the tied parameter alone, ``bucket:<owner>:tie<i>``
  (``:tp<t>`` per tensor-parallel position), on the unit's devices, with the owner's ZeRO
  level (``shards = N`` from ZeRO-1 on) and the other units' buckets as its ``mirrors``;
  the tied parameter leaves the holders' other buckets. With ZeRO-0 one ``ALL_REDUCE`` over
  every unit's ranks (stream ``tie``) sums the full gradients; from ZeRO-1 on each unit
  reduce-scatters within itself (after every pass of its holders, per microbatch from ZeRO-2),
  then one ``ALL_REDUCE`` per shard position ``j`` over the units' ``j``-th ranks sums that
  shard (stream ``tie``; the mirror sum of section 7), and the unit gathers (ZeRO-1/2) or
  materializes around every chain of its holders' uses (ZeRO-3) within itself.

Refused (``MemoryPlanError`` naming the tie and every holder's use): a tied parameter cut by
expert parallelism, or by tensor parallelism in some holders and not in others or not alike
(a vocabulary-parallel embedding and head cut it alike: each position's unit holds its
rows, and the buckets carry the pieces' sizes), holders on overlapping but different device groups, units of
different sizes or ZeRO levels, and holders with mirrored replicas sharded per direction
(DualPipe with ZeRO-2/3).
"""

from __future__ import annotations

import attrs

from piper_ir import (
    Bucket,
    Graph,
    MemoryPlanError,
    NodeKind,
    Replication,
    ShardKind,
)


@attrs.frozen
class TieUnit:
    """The holders of tie ``tie`` that sit on ``devices`` (one family's ranks of each):
    ``holders`` in segment order, the first the owner; ``bucket`` (``None`` when nothing is
    reduced) and ``replication``, the owner's settings on the unit's devices."""

    tie: int
    family: int
    devices: tuple[int, ...]
    holders: tuple[str, ...]
    replication: Replication
    bucket: Bucket | None = None

    @property
    def owner(self) -> str:
        return self.holders[0]


def tie_units(graph: Graph) -> list[list[TieUnit]]:
    """Per (tie, family), its units (module doc), buckets filled in; refusals raise
    ``MemoryPlanError``."""
    out: list[list[TieUnit]] = []
    groups = _placement_groups(graph)
    replication = {r.segment: r for r in graph.replication}
    sharding = {s.segment: s for s in graph.sharding}
    for index, tie in enumerate(graph.ties):
        _check_uncut(graph, tie, index)
        families: dict[int, dict[tuple[int, ...], list[str]]] = {}
        for seg, _ in tie.holders:
            for t, devices in enumerate(_families(groups[seg], sharding.get(seg))):
                families.setdefault(t, {}).setdefault(devices, []).append(seg)
        counts = {len(_families(groups[seg], sharding.get(seg))) for seg, _ in tie.holders}
        if len(counts) > 1:
            _refuse(tie, "its holders are tensor-parallel to different degrees")
        for t, units in sorted(families.items()):
            _check_units(graph, tie, units)
            made = [_unit(graph, tie, index, t, devices, holders, replication) for devices, holders in units.items()]
            if len(made) > 1 or len(made[0].devices) > 1:
                made = _with_buckets(graph, tie, index, t, made)
            out.append(made)
    return out


def tie_buckets(graph: Graph, units: list[list[TieUnit]]) -> tuple[Bucket, ...]:
    """``graph.buckets`` without the tied parameters, plus the units' buckets (after their
    owners' other buckets)."""
    tied = {(seg, qualname) for tie in graph.ties for seg, qualname in tie.holders}
    extra: dict[str, list[Bucket]] = {}
    for family in units:
        for unit in family:
            if unit.bucket is not None:
                extra.setdefault(unit.owner, []).append(unit.bucket)
    out: list[Bucket] = []
    order = [s.id for s in graph.segments]
    by_segment: dict[str, list[Bucket]] = {}
    for b in graph.buckets:
        kept = tuple(n for n in b.params if (b.segment, n) not in tied)
        if kept == b.params:
            by_segment.setdefault(b.segment, []).append(b)
        elif kept:
            gone = sum(_local_meta(graph, b.segment, n).numel() for n in b.params if n not in kept)
            by_segment.setdefault(b.segment, []).append(attrs.evolve(b, params=kept, numel=b.numel - gone))
    for seg in order:
        out += by_segment.get(seg, []) + extra.get(seg, [])
    return tuple(out)


def _local_meta(graph: Graph, segment: str, name: str):  # a TensorMeta
    """The meta of one rank's piece of parameter ``name`` of ``segment`` (the whole if uncut)."""
    meta = dict(graph.segment_by_id[segment].params)[name]
    sh = next((s for s in graph.sharding if s.segment == segment), None)
    return meta if sh is None else sh.local_meta(name, meta)


def _placement_groups(graph: Graph) -> dict[str, tuple[int, ...]]:
    """Each segment's placement group: the devices of its optimizer node (the sorted union of
    its microbatches' groups for mirrored replicas), else of its compute."""
    out: dict[str, set[int]] = {}
    for n in graph.nodes:
        if n.segment is not None and n.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER):
            out.setdefault(n.segment, set()).update(n.devices)
    opts = {n.segment: n.devices for n in graph.nodes if n.kind is NodeKind.OPTIMIZER and n.devices}
    return {seg: opts.get(seg, tuple(sorted(devices))) for seg, devices in out.items()}


def _families(group: tuple[int, ...], sh) -> list[tuple[int, ...]]:  # a Sharding or None
    """The sets of ranks over which a holder's copies are replicas of one another."""
    if sh is None or sh.kind is not ShardKind.TP:
        return [group]  # an expert-parallel group is data-parallel for all but the experts
    return [sh.holders(t) for t in range(sh.degree)]


def _refuse(tie, why: str) -> None:  # a Tie
    raise MemoryPlanError(
        f"parameter {tie.name!r} is tied (one tensor used by several regions: {tie.describe()}), and {why}. "
        "Piper cannot keep its copies in sync there; change the strategy or untie the parameter "
        "(give each region its own)."
    )


def _check_uncut(graph: Graph, tie, index: int) -> None:  # a Tie
    """A tie is cut by no holder, or by every holder alike (tensor parallelism of one
    degree, the same ``ParamShard``: a vocabulary-parallel embedding and head), so that the
    ranks at one position hold pieces of one parameter."""
    held = set(tie.holders)
    cuts = {(sh.segment, spec.name): (sh, spec) for sh in graph.sharding for spec in sh.params
            if (sh.segment, spec.name) in held}
    for sh, _ in cuts.values():
        if sh.kind is not ShardKind.TP:
            _refuse(tie, f"{sh.kind}-parallelism cuts it in {sh.segment} ({sh.origin})")
    alike = {(sh.degree, spec.dim, spec.groups) for sh, spec in cuts.values()}
    if cuts and (len(cuts) != len(held) or len(alike) > 1):
        sh = next(iter(cuts.values()))[0]
        _refuse(tie, f"tensor parallelism cuts it in {sorted({s.segment for s, _ in cuts.values()})} ({sh.origin}) "
                "but not in every holder alike")
    holders = {seg for seg, _ in tie.holders}
    if any(b.mirrors and b.segment in holders for b in graph.buckets if ":tie" not in b.id):
        _refuse(tie, "a holder has mirrored replicas sharded per direction (DualPipe with ZeRO-2/3); "
                "use ZeRO 0 or 1, or another schedule")


def _check_units(graph: Graph, tie, units: dict[tuple[int, ...], list[str]]) -> None:  # a Tie
    seen: dict[int, tuple[int, ...]] = {}
    for devices in units:
        for d in devices:
            if d in seen and seen[d] != devices:
                _refuse(tie, f"its holders sit on overlapping device groups {list(seen[d])} and {list(devices)}")
            seen[d] = devices
    if len({len(d) for d in units}) > 1:
        _refuse(tie, f"its holders sit on device groups of different sizes {[list(d) for d in units]}")


def _unit(
    graph: Graph, tie, index: int, family: int, devices: tuple[int, ...], holders: list[str],
    replication: dict[str, Replication],
) -> TieUnit:
    zeros = {replication[s].zero if s in replication else 0 for s in holders}
    if len(zeros) > 1:
        _refuse(tie, f"its holders {holders} are replicated with different ZeRO levels {sorted(zeros)}")
    owner = holders[0]
    rep = replication.get(owner)
    record = Replication(owner, devices) if rep is None else attrs.evolve(rep, devices=devices)
    return TieUnit(index, family, devices, tuple(holders), record)


def _with_buckets(graph: Graph, tie, index: int, family: int, units: list[TieUnit]) -> list[TieUnit]:
    """Each unit with its bucket, every bucket naming the others as its mirrors."""
    if len({u.replication.zero for u in units}) > 1:
        _refuse(tie, f"its holders are replicated with different ZeRO levels {sorted({u.replication.zero for u in units})}")
    sharding = {s.segment: s for s in graph.sharding}
    suffix = f":tp{family}" if any(
        (sh := sharding.get(u.owner)) is not None and sh.kind is ShardKind.TP for u in units
    ) else ""
    qualname = dict(tie.holders)
    ids = [f"bucket:{u.owner}:tie{index}{suffix}" for u in units]
    out = []
    for u, bid in zip(units, ids, strict=True):
        meta = _local_meta(graph, u.owner, qualname[u.owner])
        shards = len(u.devices) if u.replication.zero >= 1 else 1
        bucket = Bucket(
            bid, u.owner, (qualname[u.owner],), meta.numel(), shards, meta.dtype, u.devices,
            tuple(m for m in ids if m != bid),
        )
        out.append(attrs.evolve(u, bucket=bucket))
    return out
