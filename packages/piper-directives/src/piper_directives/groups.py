"""What a placed graph says about device groups: which segments a directive's filter
matches, and the group each segment runs on.

``Place`` uses these to build a placement; ``Shard`` and ``Replicate`` describe a placement
already made, and use them to check they name the group a ``Place`` made (``directive_per_segment``:
one ``Shard`` or ``ContextParallel`` per segment of every multi-device group); ``data_parallel``
uses ``segment_group`` for regions placed per microbatch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, TypeVar

from piper_ir import (
    MB,
    PASS,
    DirectiveError,
    Filter,
    Graph,
    Node,
    NodeKind,
    Phase,
    Segment,
    SegmentRole,
    compute_id,
)

# The kinds whose device groups place a segment, as one set: ``NodeKind.COMPUTE`` read per
# node goes through the enum's descriptor.
PLACED_KINDS = frozenset({NodeKind.COMPUTE, NodeKind.OPTIMIZER})


class OnGroup(Protocol):
    """A directive about the regions ``filter`` matches, placed on ``devices``."""

    @property
    def filter(self) -> Filter: ...

    @property
    def devices(self) -> tuple[int, ...]: ...


def segment_matches(flt: Filter, seg: Segment) -> bool:
    """Whether ``flt`` selects segment ``seg`` (its ``PASS`` and ``MB`` keys aside: a region
    is placed whole). The loss segment is matched only by name (``{"SEG": "loss"}``)."""
    if seg.role is SegmentRole.LOSS and dict(flt.items).get("SEG") != seg.id:
        return False
    probe = Node(compute_id(Phase.F, seg.id), NodeKind.COMPUTE, seg.id, Phase.F, tags=seg.tags)
    return Filter(tuple((k, v) for k, v in flt.items if k not in (PASS, MB))).matches(probe)


def segment_group(groups: Iterable[tuple[int, ...] | None]) -> tuple[int, ...]:
    """The devices holding a segment's parameters, from the groups of its microbatches: their
    common group, or the sorted union when microbatches run on different groups (mirrored
    replicas, as in DualPipe, whose gradients are summed over the union)."""
    distinct = list(dict.fromkeys(g for g in groups if g is not None))
    if len(distinct) == 1:
        return distinct[0]
    return tuple(sorted({d for g in distinct for d in g}))


def placement_groups(graph: Graph) -> dict[str, tuple[int, ...]]:
    """The device group of every placed segment (``segment_group`` of its compute's groups),
    segments in the order the nodes name them first. Each (segment, group) pair is told
    apart first, in graph order: a segment runs its microbatches on one group or a few (131k
    compute nodes at 16,384 devices, a few hundred pairs)."""
    groups: dict[str, list[tuple[int, ...]]] = {}
    pairs = dict.fromkeys((n.segment, n.devices) for n in graph.nodes if n.kind in PLACED_KINDS)
    for segment, devices in pairs:
        if segment is not None:
            groups.setdefault(segment, []).append(devices)
    return {seg: segment_group(gs) for seg, gs in groups.items()}


def segments_on_group(graph: Graph, directive: OnGroup, group: dict[str, tuple[int, ...]]) -> Iterator[Segment]:
    """The segments ``directive.filter`` matches, each checked, as it is yielded, to be placed
    on exactly ``directive.devices`` (a ``Replicate`` or ``Shard`` describes a placement)."""
    matched = [s for s in graph.segments if segment_matches(directive.filter, s)]
    if not matched:
        raise DirectiveError(f"filter {directive.filter} matches no annotated region", directive=str(directive))
    kind = type(directive).__name__
    for seg in matched:
        placed = group.get(seg.id, ())
        if placed != directive.devices:
            raise DirectiveError(
                f"segment {seg.id} ({seg.tags}) is placed on {list(placed)}, but {kind} names "
                f"{list(directive.devices)}; the devices must be the placement group, in the same order",
                directive=str(directive),
                nodes=[compute_id(Phase.F, seg.id)],
            )
        yield seg


G = TypeVar("G", bound=OnGroup)


def directive_per_segment(graph: Graph, directives: list[G], group: dict[str, tuple[int, ...]],
                          missing: str) -> dict[str, G]:
    """Segment id -> the first of ``directives`` (``Shard``s, ``ContextParallel``s) whose group
    it runs on; the loss segment, unmatched, takes its producer's group's (it runs where the
    model's output is made). Every segment placed on several devices must have one: else a
    ``DirectiveError`` naming it and ``missing`` (what is missing and how to give it)."""
    chosen: dict[str, G] = {}
    for directive in directives:
        for seg in segments_on_group(graph, directive, group):
            chosen.setdefault(seg.id, directive)
    loss = graph.loss_segment()
    if loss.id not in chosen:
        owner = next((chosen[s] for s, g in group.items() if s in chosen and g == group.get(loss.id)), None)
        if owner is not None:
            chosen[loss.id] = owner
    for seg in graph.segments:
        devices = group.get(seg.id, ())
        if len(devices) > 1 and seg.id not in chosen:
            raise DirectiveError(
                f"segment {seg.id} ({seg.tags}) is placed on {list(devices)} without {missing}",
                directive=str(directives[0]),
                nodes=[compute_id(Phase.F, seg.id)],
            )
    return chosen
