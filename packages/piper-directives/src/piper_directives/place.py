"""``Place``: put annotated regions on device groups.

``Place(filter, devices)`` assigns every segment whose tags match ``filter`` to the device
group ``devices`` (the SPMD replicas of the region; one device for plain pipelining). With
``MB`` in the filter only those microbatches go there. ``stream`` names the logical stream
of the sends and receives that carry the region's outputs (``send_streams``).

``place_all(graph, places)`` is the Place phase of ``Strategy.apply``. Requires a graph that
is not placed yet. Guarantees: every compute node runs on its microbatch's group, every
optimizer node on its segment's group (``groups.segment_group``: the union for a segment
whose microbatches run on several groups), ``world_size`` is set, and every device
``0 .. world_size - 1`` holds a region. The loss segment, unless a ``Place`` names it
(``{"SEG": "loss"}``), goes with the segment producing the model's output. Communication is
inserted later (``communication.insert_communication``), after sharding and replication.
"""

from __future__ import annotations

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
from piper_directives.groups import segment_group, segment_matches
from piper_directives.split import copier
from piper_ir import (
    ANY,
    MB,
    PASS,
    SEG,
    DirectiveError,
    Edge,
    Filter,
    Graph,
    Node,
    NodeKind,
    Phase,
    Segment,
    compute_id,
)

# (segment, microbatch) -> what it maps to; microbatch None stands for every microbatch.
Key = tuple[str, int | None]


@attrs.frozen
class Place:
    op: ClassVar[str] = "place"

    filter: Filter = attrs.field(converter=to_filter)
    devices: tuple[int, ...] = attrs.field(converter=to_devices)
    stream: str = "pp"
    where: str = attrs.field(factory=user_location, eq=False)

    def __str__(self) -> str:
        return f"Place({self.filter}, devices={list(self.devices)}, stream={self.stream!r}) at {self.where}"

    def to_json(self) -> JsonObject:
        return {"op": self.op, "filter": self.filter.as_dict(), "devices": list(self.devices), "stream": self.stream}

    @classmethod
    def from_json(cls, item: JsonObject, where: str) -> Place:
        return cls(**{**item, "filter": filter_from_json(item["filter"], where),
                      "devices": devices_from_json(item["devices"], where)}, where=where)


def place_all(graph: Graph, places: Sequence[Place]) -> Graph:
    """Apply ``places`` in order and check every segment is placed (module doc)."""
    if graph.world_size:
        raise DirectiveError("the graph is already placed", directive=str(places[0]) if places else None)
    group: dict[Key, tuple[int, ...]] = {}
    placed_by: dict[Key, Place] = {}
    sizes: set[int] = set()
    by_tag = _segments_by_tag(graph)
    for place in places:
        _check_devices(place)
        for seg in _matched(graph, place, by_tag):
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
            nodes=[compute_id(Phase.F, s.id) for s, _ in unplaced],
        )
    loss = graph.loss_segment()
    unplaced_loss = [mb for mb in mbs if _group_of(group, loss.id, mb) is None]
    if unplaced_loss:
        into = _edges_into(graph, {compute_id(Phase.F, loss.id, mb) for mb in unplaced_loss})
        for mb in unplaced_loss:
            group[(loss.id, mb)] = _loss_group(graph, group, loss.id, mb, into)
    used = sorted({d for g in group.values() for d in g})
    world = used[-1] + 1
    idle = sorted(set(range(world)) - set(used))
    if idle:
        # Blame the first Place that names a device beyond the gap (device 99 of a 2-device
        # pipeline), and say the gap as a range, not 98 numbers.
        culprit = next((p for p in places if any(d > idle[0] for d in p.devices)), None)
        gap = _ranges(idle)
        if culprit is None:
            raise DirectiveError(f"devices {gap} hold no region; number devices 0..N-1 without gaps")
        beyond = sorted(d for d in culprit.devices if d > idle[0])
        raise DirectiveError(
            f"this Place names device{'s' if len(beyond) > 1 else ''} {_ranges(beyond)}, but "
            + (f"devices {gap} hold" if len(idle) > 1 else f"device {gap} holds")
            + " no region; number devices 0..N-1 without gaps",
            directive=str(culprit),
        )
    whole = {s.id: segment_group([_group_of(group, s.id, mb) for mb in mbs]) for s in graph.segments}
    with_devices = copier(Node, "devices")  # attrs.evolve, made for a copy of every node
    # A compute node runs on its microbatch's group, the optimizer on the segment's (one
    # loop, no call per node: a copy of every compute node, 131k at 16,384 devices).
    nodes: list[Node] = []
    get, append, compute = group.get, nodes.append, NodeKind.COMPUTE
    for n in graph.nodes:
        seg = n.segment
        if seg is None:
            append(n)
        elif n.kind is compute:
            devices = get((seg, n.microbatch))
            if devices is None:
                devices = get((seg, None))
            append(with_devices(n, devices or whole[seg]))
        else:
            append(with_devices(n, whole[seg]))
    return attrs.evolve(graph, nodes=tuple(nodes), world_size=world)


def _ranges(numbers: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1..3, 7``."""
    parts: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(parts)


def send_streams(graph: Graph, places: Sequence[Place]) -> dict[str, str]:
    """Segment id -> the ``stream`` of the ``Place`` that placed it, for the sends carrying
    its outputs (``insert_communication``). A segment placed per microbatch by several
    Places takes the stream of the one recorded for its last-placed microbatch, as
    ``place_all`` records them. Requires ``places`` that ``place_all`` accepted."""
    placed_by: dict[Key, Place] = {}
    by_tag = _segments_by_tag(graph)
    for place in places:
        for seg in _matched(graph, place, by_tag):
            for mb in _place_microbatches(graph, place):
                placed_by[(seg.id, mb)] = place
    return {seg: place.stream for (seg, _), place in placed_by.items()}


def _segments_by_tag(graph: Graph) -> dict[tuple[str, object], list[Segment]]:
    """The segments carrying each (tag, value), in graph order: what ``_matched`` looks a
    filter's exact tag up in."""
    out: dict[tuple[str, object], list[Segment]] = {}
    for s in graph.segments:
        for item in s.tags.items:
            out.setdefault(item, []).append(s)
    return out


def _matched(graph: Graph, place: Place, by_tag: dict[tuple[str, object], list[Segment]]) -> list[Segment]:
    """The segments ``place`` puts on its devices, in graph order. A filter with an exact tag
    value (``{"PP": 3}``) is tested only on the segments carrying it (``by_tag``:
    ``_segments_by_tag(graph)``), which are the only ones it can match: a schedule writes one
    Place per stage, and testing every segment against each made Place cost stages squared."""
    exact = next(
        (item for item in place.filter.items
         if item[0] not in (PASS, MB, SEG) and item[1] != ANY and not isinstance(item[1], tuple)),
        None,
    )
    pool = graph.segments if exact is None else by_tag.get(exact, ())
    matched = [s for s in pool if segment_matches(place.filter, s)]
    if not matched:
        raise DirectiveError(f"filter {place.filter} matches no annotated region", directive=str(place))
    return matched


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


def _record(group: dict[Key, tuple[int, ...]], placed_by: dict[Key, Place], key: Key, place: Place) -> None:
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


def _group_of(group: dict[Key, tuple[int, ...]], seg: str, mb: int | None) -> tuple[int, ...] | None:
    return group.get((seg, mb), group.get((seg, None)))


def _edges_into(graph: Graph, ids: set[str]) -> dict[str, list[Edge]]:
    """The edges into each of ``ids``, in edge order: what ``graph.predecessors`` says of
    them, without indexing every edge of a graph that is about to be replaced."""
    out: dict[str, list[Edge]] = {}
    for e in graph.edges:
        if e.dst in ids:
            out.setdefault(e.dst, []).append(e)
    return out


def _loss_group(
    graph: Graph, group: dict[Key, tuple[int, ...]], loss: str, mb: int | None, into: dict[str, list[Edge]]
) -> tuple[int, ...]:
    """The loss of microbatch ``mb`` goes where the model's outputs of ``mb`` are produced
    (``into``: the edges into the loss's forwards, ``_edges_into``)."""
    fwd = compute_id(Phase.F, loss, mb)
    producers = {e.src for e in into.get(fwd, ()) if e.value and not e.value.startswith("target:")}
    groups = {_group_of(group, graph.node(p).segment, mb) for p in producers}  # type: ignore[arg-type]
    if len(groups) != 1:
        raise DirectiveError("the model's outputs come from several device groups: place the loss with {'SEG': 'loss'}")
    return groups.pop()  # type: ignore[return-value]


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
