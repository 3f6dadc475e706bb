"""``Place``: put annotated regions on device groups, then lower cross-device data edges.

``Place(filter, devices)`` assigns every segment whose tags match ``filter`` to the device
group ``devices`` (the SPMD replicas of the region; one device for plain pipelining).
``stream`` names the logical stream of the sends and receives that carry the region's outputs.

``place_all`` applies every ``Place`` of a strategy and then inserts SEND/RECV pairs for each
data edge whose ends sit on different devices (docs/ir-conventions.md, section 3). The loss
segment, unless a ``Place`` names it (``{"SEG": "loss"}``), goes with the segment producing
the model's output.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import attrs

from piper_directives.source import user_location
from piper_ir import MB, PASS, DirectiveError, Edge, Filter, Graph, Node, NodeKind, Segment, SegmentRole

if TYPE_CHECKING:
    from piper_directives.replicate import Replicate
    from piper_directives.shard import Shard


def _to_filter(value: object) -> Filter:
    if isinstance(value, Filter):
        return value
    if isinstance(value, dict):
        return Filter.of(value)
    raise TypeError(f"expected a Filter or a dict, got {value!r}")


@attrs.frozen
class Place:
    filter: Filter = attrs.field(converter=_to_filter)
    devices: tuple[int, ...] = attrs.field(converter=lambda d: (d,) if isinstance(d, int) else tuple(d))
    stream: str = "pp"
    where: str = attrs.field(factory=user_location, eq=False)

    def __str__(self) -> str:
        return f"Place({self.filter}, devices={list(self.devices)}, stream={self.stream!r}) at {self.where}"


def place_all(
    graph: Graph, places: Sequence[Place], replicates: Sequence[Replicate] = (), shards: Sequence[Shard] = ()
) -> Graph:
    """Apply ``places`` in order, check every segment is placed, record which groups are
    tensor-parallel (``shard_all``) and how replicated groups stay in sync (``replicate_all``),
    then insert communication."""
    from piper_directives.replicate import replicate_all  # replicate.py builds on this module
    from piper_directives.shard import shard_all

    if graph.world_size:
        raise DirectiveError("the graph is already placed", directive=str(places[0]) if places else None)
    # (segment, microbatch) -> device group; microbatch None stands for every microbatch.
    group: dict[tuple[str, int | None], tuple[int, ...]] = {}
    placed_by: dict[tuple[str, int | None], Place] = {}
    sizes: set[int] = set()
    for place in places:
        _check_devices(place)
        matched = [s for s in graph.segments if _segment_matches(place.filter, s)]
        if not matched:
            raise DirectiveError(f"filter {place.filter} matches no annotated region", directive=str(place))
        for seg in matched:
            for mb in _place_microbatches(graph, place):
                _record(group, placed_by, (seg.id, mb), place)
        if len(place.devices) > 1:
            sizes.add(len(place.devices))
            if len(sizes) > 1:
                raise DirectiveError(
                    f"device groups of different sizes {sorted(sizes)}: every multi-device group of a "
                    "strategy has the same size (the data-parallel degree)",
                    directive=str(place),
                )
    mbs = _microbatch_ids(graph)
    missing = {s: [mb for mb in mbs if _group_of(group, s.id, mb) is None] for s in graph.stage_segments()}
    unplaced = [(s, m) for s, m in missing.items() if m]
    if unplaced:
        names = ", ".join(
            f"{s.id} ({s.tags})" + ("" if len(m) == len(mbs) else f" microbatches {m}") for s, m in unplaced
        )
        raise DirectiveError(
            f"{len(unplaced)} annotated region(s) are not placed by any Place directive: {names}",
            nodes=[f"F.{s.id}" for s, _ in unplaced],
        )
    loss = graph.loss_segment()
    for mb in mbs:
        if _group_of(group, loss.id, mb) is None:
            group[(loss.id, mb)] = _loss_group(graph, group, loss.id, mb)
    used = sorted({d for g in group.values() for d in g})
    world = used[-1] + 1
    idle = sorted(set(range(world)) - set(used))
    if idle:
        raise DirectiveError(f"devices {idle} hold no region; number devices 0..N-1 without gaps")
    whole = {s.id: segment_group([_group_of(group, s.id, mb) for mb in mbs]) for s in graph.segments}
    nodes = tuple(
        attrs.evolve(n, devices=_node_group(n, group, whole)) if n.segment is not None else n
        for n in graph.nodes
    )
    placed = attrs.evolve(graph, nodes=nodes, world_size=world)
    placed = replicate_all(shard_all(placed, shards, replicates), replicates)
    streams = {seg: place.stream for (seg, _), place in placed_by.items()}
    return insert_communication(placed, streams)


def _microbatch_ids(graph: Graph) -> list[int | None]:
    """The microbatch numbers compute nodes carry (``None`` in a graph that is not split)."""
    return list(range(graph.microbatches)) if any(n.microbatch is not None for n in graph.nodes) else [None]


def _place_microbatches(graph: Graph, place: Place) -> list[int | None]:
    """``[None]`` (all of them) for a ``Place`` without ``MB``, else the microbatches it names."""
    if MB not in place.filter.as_dict():
        return [None]
    only = Filter(tuple(item for item in place.filter.items if item[0] == MB))
    ids = [
        mb
        for mb in _microbatch_ids(graph)
        if mb is not None and only.matches(Node("p", NodeKind.COMPUTE, microbatch=mb))
    ]
    if not ids:
        raise DirectiveError(
            f"filter {place.filter} names microbatches the graph does not have ({graph.microbatches} microbatches)",
            directive=str(place),
        )
    return ids


def _record(group: dict, placed_by: dict, key: tuple[str, int | None], place: Place) -> None:
    """Place one segment (one microbatch of it, or all when ``key[1]`` is None) on
    ``place.devices``; placing it again elsewhere is an error."""
    seg, mb = key
    clashes = [k for k in ((seg, None), key) if k in group and group[k] != place.devices]
    if mb is None:  # a whole-segment Place also clashes with any microbatch placed elsewhere
        clashes += [k for k in group if k[0] == seg and group[k] != place.devices]
    if clashes:
        k = clashes[0]
        which = mb if mb is not None else k[1]
        what = seg if which is None else f"{seg} microbatch {which}"
        raise DirectiveError(
            f"segment {what} is placed twice: on {list(group[k])} by {placed_by[k]} and on {list(place.devices)}",
            directive=str(place),
        )
    group[key] = place.devices
    placed_by[key] = place


def _group_of(group: dict, seg: str, mb: int | None) -> tuple[int, ...] | None:
    return group.get((seg, mb), group.get((seg, None)))


def _loss_group(graph: Graph, group: dict, loss: str, mb: int | None) -> tuple[int, ...]:
    """The loss of microbatch ``mb`` goes where the model's outputs of ``mb`` are produced."""
    fwd = f"F.{loss}" if mb is None else f"F.{loss}.mb{mb}"
    producers = {
        e.src for e in graph.predecessors.get(fwd, ()) if e.value and not e.value.startswith("target:")
    }
    groups = {_group_of(group, graph.node(p).segment, mb) for p in producers}  # type: ignore[arg-type]
    if len(groups) != 1:
        raise DirectiveError("the model's outputs come from several device groups: place the loss with {'SEG': 'loss'}")
    return groups.pop()  # type: ignore[return-value]


def segment_group(groups: Iterable[tuple[int, ...] | None]) -> tuple[int, ...]:
    """The devices holding a segment's parameters, from the groups of its microbatches: their
    common group, or the sorted union when microbatches run on different groups (mirrored
    replicas, as in DualPipe, whose gradients are summed over the union)."""
    distinct = list(dict.fromkeys(g for g in groups if g is not None))
    if len(distinct) == 1:
        return distinct[0]
    return tuple(sorted({d for g in distinct for d in g}))


def _node_group(n: Node, group: dict, whole: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """A compute node runs on its microbatch's group; the optimizer on the segment's."""
    if n.kind is NodeKind.COMPUTE:
        return _group_of(group, n.segment, n.microbatch) or whole[n.segment]
    return whole[n.segment]


def _check_devices(place: Place) -> None:
    if not place.devices:
        raise DirectiveError("Place needs at least one device", directive=str(place))
    seen: set[int] = set()
    for d in place.devices:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise DirectiveError(f"device {d!r} is not a non-negative int", directive=str(place))
        if d in seen:
            raise DirectiveError(f"device {d} is named twice in one device group", directive=str(place))
        seen.add(d)


def _segment_matches(flt: Filter, seg) -> bool:
    from piper_ir import Phase

    if seg.role is SegmentRole.LOSS and dict(flt.items).get("SEG") != seg.id:
        return False
    probe = Node(f"F.{seg.id}", NodeKind.COMPUTE, seg.id, Phase.F, tags=seg.tags)
    return Filter(tuple((k, v) for k, v in flt.items if k not in (PASS, MB))).matches(probe)


def insert_communication(graph: Graph, streams: dict[str, str]) -> Graph:
    """Replace each cross-device data edge with SEND -> RECV (one pair per value, microbatch
    and pair of device groups, shared by every consumer on the receiving group).

    Groups pair elementwise (docs/ir-conventions.md, section 7): replica ``j`` of the
    producing group sends to replica ``j`` of the consuming one, so both groups must have the
    same size and no replica may send to itself. Single-device groups are the case N = 1.
    """
    by_id = graph.node_by_id
    nodes = list(graph.nodes)
    edges: list[Edge] = []
    pairs: dict[tuple[str, int | None, tuple[int, ...], tuple[int, ...]], tuple[str, str]] = {}
    for e in graph.edges:
        src, dst = by_id[e.src], by_id[e.dst]
        if e.value is None or src.devices == dst.devices:
            edges.append(e)
            continue
        s_devs, d_devs = src.devices, dst.devices
        if len(s_devs) != len(d_devs):
            raise DirectiveError(
                f"value {e.value} flows from device group {list(s_devs)} to {list(d_devs)}: replicas pair "
                "up elementwise, so both groups need the same number of devices",
                nodes=[e.src, e.dst],
            )
        selfs = [a for a, b in zip(s_devs, d_devs, strict=True) if a == b]
        if selfs:
            raise DirectiveError(
                f"value {e.value} flows from device group {list(s_devs)} to {list(d_devs)}: paired "
                f"elementwise, device {selfs[0]} would send to itself; list both groups in replica order",
                nodes=[e.src, e.dst],
            )
        key = (e.value, src.microbatch, s_devs, d_devs)
        if key not in pairs:
            mb = "" if src.microbatch is None else f".mb{src.microbatch}"
            ends = f"{'_'.join(map(str, s_devs))}-{'_'.join(map(str, d_devs))}"
            sid, rid = f"send.{e.value}{mb}.{ends}", f"recv.{e.value}{mb}.{ends}"
            stream = streams.get(src.segment or "", "pp")
            common = dict(value=e.value, microbatch=src.microbatch, tags=src.tags, stream=stream)
            nodes.append(Node(sid, NodeKind.SEND, devices=s_devs, peers=d_devs, **common))
            nodes.append(Node(rid, NodeKind.RECV, devices=d_devs, peers=s_devs, **common))
            edges.append(Edge(e.src, sid, value=e.value))
            edges.append(Edge(sid, rid, value=e.value))
            pairs[key] = (sid, rid)
        edges.append(Edge(pairs[key][1], e.dst, value=e.value))
    return attrs.evolve(graph, nodes=tuple(nodes), edges=tuple(edges))


def placement_groups(graph: Graph) -> dict[str, tuple[int, ...]]:
    """The device group of every placed segment (``segment_group`` of its compute's groups)."""
    groups: dict[str, list[tuple[int, ...]]] = {}
    for n in graph.nodes:
        if n.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER) and n.segment is not None:
            groups.setdefault(n.segment, []).append(n.devices)
    return {seg: segment_group(gs) for seg, gs in groups.items()}


def segments_on_group(graph: Graph, directive, group: dict[str, tuple[int, ...]]) -> Iterator[Segment]:
    """The segments ``directive.filter`` matches, each checked, as it is yielded, to be placed
    on exactly ``directive.devices`` (a ``Replicate`` or ``Shard`` describes a placement)."""
    matched = [s for s in graph.segments if _segment_matches(directive.filter, s)]
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
                nodes=[f"F.{seg.id}"],
            )
        yield seg
