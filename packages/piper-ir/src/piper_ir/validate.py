"""Cross-node invariants of a ``Graph``; ``validate`` raises ``ValidationError`` on the first."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from piper_ir.algorithms import find_cycle, is_acyclic
from piper_ir.errors import ValidationError
from piper_ir.graph import EdgeKind, Graph, NodeKind

_P2P = (NodeKind.SEND, NodeKind.RECV)
# Graphs that passed, by (id, whether their cycles were checked): a Graph is frozen, so it
# stays valid, and ``Strategy.apply`` then ``compile_program`` validate the same one twice.
_VALID: weakref.WeakValueDictionary[tuple[int, bool], Graph] = weakref.WeakValueDictionary()


def validate(graph: Graph, *, cycles: bool = True) -> Graph:
    """Check that ``graph`` is well formed and return it unchanged.

    - node ids, segment ids and value names are unique;
    - edges name existing nodes, data edges name existing values;
    - compute nodes name existing segments; microbatches lie in ``[0, graph.microbatches)``;
    - placements are consistent: a device group has no repeated device and lies inside
      ``[0, world_size)``; send/receive peers pair up with devices;
    - data and temporal edges together have no cycle;
    - every tie names at least two distinct segments, each holding the tied parameter under
      the given name with the same meta, and no parameter is in two ties;
    - a precision names known floating-point dtypes.

    ``cycles=False`` skips the cycle check, for a caller that walks the graph in topological
    order anyway (``compile_program``): it raises ``cycle_error(graph)`` when that walk stalls.
    A graph object that passed already (with its cycles checked, if ``cycles``) is not
    walked again.
    """
    if _VALID.get((id(graph), True)) is graph or (not cycles and _VALID.get((id(graph), False)) is graph):
        return graph
    # ``node_position`` keeps one entry per id, as ``node_by_id`` does; the passes after
    # (the cycle check, ``compile_program``) walk the graph by it, and none needs the other.
    _unique("node id", (n.id for n in graph.nodes), len(graph.node_position), len(graph.nodes))
    _unique("segment id", [s.id for s in graph.segments], len(graph.segment_by_id))
    _unique("value name", [v.name for v in graph.values], len(graph.value_by_name))
    values = graph.value_by_name
    # ``successor_positions`` exists only when every edge names known nodes (and no id is
    # used twice, which the check above refused): then no edge needs a lookup in the node
    # table (a million at 16,384 devices, each a likely miss of the CPU's caches). Every
    # caller walks the graph by it next (the cycle check, ``compile_program``).
    ends_known = graph.successor_positions is not None
    # The values the edges carry, as a set made in one tight pass: when each is a value of
    # the graph (the common case), no edge can fail below, and with its ends known no edge
    # needs looking at one by one.
    carried = {e.value for e in graph.edges}
    carried.discard(None)
    clean = ends_known and carried <= values.keys()
    nodes = graph.node_by_id if not clean else {}
    for e in () if clean else graph.edges:
        if not ends_known and (e.src not in nodes or e.dst not in nodes):
            end = e.src if e.src not in nodes else e.dst
            raise ValidationError(f"edge {e} names unknown node {end!r}", nodes=[end])
        if e.value is not None and e.value not in values and e.kind is EdgeKind.DATA:
            raise ValidationError(f"edge {e} carries unknown value {e.value!r}", nodes=[e.src, e.dst])
    segments, microbatches, world = graph.segment_by_id, graph.microbatches, graph.world_size
    for n in () if _nodes_sound(graph) else graph.nodes:  # the first node that fails, named
        if n.segment is not None and n.segment not in segments:
            raise ValidationError(f"node {n.id} names unknown segment {n.segment!r}", nodes=[n.id])
        if n.microbatch is not None and not 0 <= n.microbatch < microbatches:
            raise ValidationError(
                f"node {n.id} has microbatch {n.microbatch} outside [0, {microbatches})",
                nodes=[n.id],
            )
        devices = n.devices
        if not devices:
            if n.peers and n.kind in _P2P:
                raise ValidationError(f"{n.kind.value} node {n.id} has peers {list(n.peers)} for devices []", nodes=[n.id])
            continue
        if len(devices) > 1 and len(set(devices)) != len(devices):
            raise ValidationError(f"node {n.id} names a device twice: {list(devices)}", nodes=[n.id])
        if world and not (0 <= min(devices) and max(devices) < world):
            raise ValidationError(
                f"node {n.id} is placed on {list(devices)}, outside world size {world}",
                nodes=[n.id],
            )
        if n.kind in _P2P and len(n.peers) != len(devices):
            raise ValidationError(f"{n.kind.value} node {n.id} has peers {list(n.peers)} for devices {list(devices)}", nodes=[n.id])
    _check_ties(graph)
    _check_precision(graph)
    if cycles and not is_acyclic(graph):
        raise cycle_error(graph)
    _VALID[(id(graph), cycles)] = graph
    return graph


def _nodes_sound(graph: Graph) -> bool:
    """Whether every node passes ``validate``'s per-node checks, told from four sets made in
    C (the segments, microbatches and device groups the nodes name, and the group and peer
    counts of the transfers: a pipeline's nodes share a few groups) instead of a loop over
    392k nodes at 16,384 devices. When this says no, that loop names the first culprit."""
    nodes, microbatches, world = graph.nodes, graph.microbatches, graph.world_size
    named = {n.segment for n in nodes}
    named.discard(None)
    if not named <= graph.segment_by_id.keys():
        return False
    numbers = {n.microbatch for n in nodes}
    numbers.discard(None)
    if not all(0 <= m < microbatches for m in numbers):  # type: ignore[operator]
        return False
    for group in {n.devices for n in nodes}:
        if group and ((len(group) > 1 and len(set(group)) != len(group))
                      or (world and not (0 <= min(group) and max(group) < world))):
            return False
    return all(d == p for d, p in {(len(n.devices), len(n.peers)) for n in nodes if n.kind in _P2P})


def cycle_error(graph: Graph) -> ValidationError:
    """The error ``validate`` raises for a cyclic ``graph``: one cycle, and the directives
    whose edges close it."""
    cycle = find_cycle(graph) or []
    # Blame only the edges on the cycle, not every edge between two of its nodes.
    steps = set(zip(cycle, cycle[1:], strict=False))
    origins = sorted({e.origin for e in graph.edges if e.origin and (e.src, e.dst) in steps})
    return ValidationError(
        "the graph has a cycle: " + " -> ".join(cycle),
        directive=", ".join(origins) or None,
        nodes=cycle,
    )


def _check_ties(graph: Graph) -> None:
    _unique("tied parameter", [t.name for t in graph.ties], len({t.name for t in graph.ties}))
    held: dict[tuple[str, str], str] = {}
    for tie in graph.ties:
        segments = [seg for seg, _ in tie.holders]
        if len(set(segments)) != len(segments) or len(segments) < 2:
            raise ValidationError(f"tie {tie.name!r} must name at least two distinct segments, got {segments}")
        metas = []
        for seg, qualname in tie.holders:
            segment = graph.segment_by_id.get(seg)
            if segment is None:
                raise ValidationError(f"tie {tie.name!r} names unknown segment {seg!r}")
            meta = dict(segment.params).get(qualname)
            if meta is None:
                raise ValidationError(f"tie {tie.name!r}: segment {seg} has no parameter {qualname!r}")
            if (seg, qualname) in held:
                raise ValidationError(f"parameter {qualname!r} of {seg} is in ties {held[seg, qualname]!r} and {tie.name!r}")
            held[seg, qualname] = tie.name
            metas.append(meta)
        if any(m.shape != metas[0].shape or m.dtype != metas[0].dtype for m in metas):
            raise ValidationError(
                f"tie {tie.name!r}: its holders disagree on shape or dtype: "
                + ", ".join(f"{seg}:{q} {m.dtype}{list(m.shape)}" for (seg, q), m in zip(tie.holders, metas, strict=True))
            )


_FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})


def _check_precision(graph: Graph) -> None:
    p = graph.precision
    if p is not None and (p.compute not in _FLOAT_DTYPES or p.master not in _FLOAT_DTYPES):
        raise ValidationError(
            f"precision {p.compute}/{p.master}: compute and master must be among {sorted(_FLOAT_DTYPES)}"
        )


def _unique(what: str, items: Iterable[str], distinct: int, count: int | None = None) -> None:
    """Raise for the first of ``items`` seen twice, unless ``distinct`` (the size of a table
    keyed by them) equals their ``count`` (by default ``len(items)``)."""
    if distinct == (len(items) if count is None else count):  # type: ignore[arg-type]
        return  # the by-id mapping kept every item: no duplicate
    seen: set[str] = set()
    for item in items:
        if item in seen:
            raise ValidationError(f"duplicate {what} {item!r}")
        seen.add(item)
