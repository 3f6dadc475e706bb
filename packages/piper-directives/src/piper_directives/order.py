"""``Order``: fix the order of compute on each device with temporal edges.

``Order(slots)`` takes a list of slots; each slot is a list of filters (one filter is the
common case). On every device, each node matched by slot ``k`` gets a temporal edge to each
node matched by the next slot ``k' > k`` that matches nodes on that device. Nodes of one
slot stay unordered relative to each other: the scheduler may interleave them (DualPipe's
overlapped forward and backward). Only compute and optimizer nodes are ordered.

Requires a placed graph. Guarantees: the result is acyclic, or a ``DirectiveError`` names
this directive, where it was written, and the nodes of the cycle.

``apply_orders(graph, orders)`` gives the same result, and raises the same first error, as
applying ``orders`` one after the other, but searches for cycles once instead of once per
``Order``: a schedule writes one ``Order`` per rank, so one by one costs ranks x graph.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import ClassVar

import attrs

from piper_directives.common import JsonObject, filter_from_json, user_location
from piper_ir import (
    SEG,
    DirectiveError,
    Edge,
    EdgeKind,
    Filter,
    Graph,
    Node,
    NodeKind,
    Phase,
    find_cycle,
    slot_maker,
)

# Read per node: on Python 3.11 ``NodeKind.COMPUTE`` and ``phase.value`` go through the enum's
# descriptors (0.1 and 0.3 us), a set or dictionary lookup does not.
ORDERABLE = frozenset({NodeKind.COMPUTE, NodeKind.OPTIMIZER})
PHASE_VALUES = {phase: phase.value for phase in Phase}
make_edge = slot_maker(Edge)


def _to_slots(value: Sequence) -> tuple[tuple[Filter, ...], ...]:
    slots = []
    for slot in value:
        if isinstance(slot, Filter | dict):
            slot = [slot]
        slots.append(tuple(f if isinstance(f, Filter) else Filter.of(f) for f in slot))
    return tuple(slots)


@attrs.frozen
class Order:
    op: ClassVar[str] = "order"

    slots: tuple[tuple[Filter, ...], ...] = attrs.field(converter=_to_slots)
    name: str = "Order"
    where: str = attrs.field(factory=user_location, eq=False)

    def __str__(self) -> str:
        return f"{self.name}({len(self.slots)} slots) at {self.where}"

    def to_json(self) -> JsonObject:
        return {"op": self.op, "name": self.name, "slots": [[f.as_dict() for f in slot] for slot in self.slots]}

    @classmethod
    def from_json(cls, item: JsonObject, where: str) -> Order:
        """``slots``: a list of slots, each a filter or a list of filters."""
        slots = item["slots"]
        if not isinstance(slots, list) or not slots:
            raise DirectiveError(f"{where}: slots must be a non-empty list")
        parsed = [[filter_from_json(f, where) for f in (s if isinstance(s, list) else [s])] for s in slots]
        return cls(**{**item, "slots": parsed}, where=where)

    def apply(self, graph: Graph) -> Graph:
        _check_placed(self, graph)
        result = attrs.evolve(graph, edges=graph.edges + tuple(self._edges(graph, _node_index(graph))))
        cycle = find_cycle(result)
        if cycle is not None:
            raise self._cycle_error(cycle)
        return result

    def _edges(self, graph: Graph, node_index: tuple[Buckets, list[Node]]) -> list[Edge]:
        """The temporal edges this order adds (raises for slots that match badly)."""
        index, orderable = node_index
        slot_of: dict[str, int] = {}
        per_device: dict[int, list[list[str]]] = defaultdict(list)
        for k, slot in enumerate(self.slots):
            matched = matching(slot[0], index, orderable) if len(slot) == 1 else [
                n for f in slot for n in matching(f, index, orderable)
            ]
            if not matched:
                shown = ", ".join(map(str, slot))
                raise DirectiveError(f"slot {k} ({shown}) matches no compute node", directive=str(self))
            if len(matched) == 1 and len(matched[0].devices) == 1:  # the common slot: one pass, one device
                n = matched[0]
                if n.id in slot_of:
                    raise DirectiveError(
                        f"node {n.id} is matched by slots {slot_of[n.id]} and {k}", directive=str(self), nodes=[n.id]
                    )
                slot_of[n.id] = k
                per_device[n.devices[0]].append([n.id])
                continue
            by_device: dict[int, list[str]] = defaultdict(list)
            for n in matched:
                if n.id in slot_of:
                    raise DirectiveError(
                        f"node {n.id} is matched by slots {slot_of[n.id]} and {k}", directive=str(self), nodes=[n.id]
                    )
                slot_of[n.id] = k
                for d in n.devices:
                    by_device[d].append(n.id)
            for d, ids in by_device.items():
                per_device[d].append(ids)
        # The devices of one group see the same slots: one edge per pair. Pairs of ids, not
        # edges, are told apart (a tuple's hash is C's, an Edge's attrs'); every edge of this
        # order has the same kind and origin.
        pairs: dict[tuple[str, str], None] = {}
        for slots in per_device.values():
            for before, after in zip(slots, slots[1:], strict=False):
                if len(before) == 1 and len(after) == 1:
                    pairs[(before[0], after[0])] = None
                else:
                    pairs.update(((a, b), None) for a in before for b in after)
        origin, temporal = str(self), EdgeKind.TEMPORAL
        # Edge(src, dst, kind, value, origin), by position through its slots
        # (``piper_ir.slot_maker``): 131k edges at 16,384 devices
        return [make_edge(a, b, temporal, None, origin) for a, b in pairs]

    def _cycle_error(self, cycle: list[str]) -> DirectiveError:
        return DirectiveError(
            "this order contradicts the data flow or an earlier order; it creates the cycle " + " -> ".join(cycle),
            directive=str(self),
            nodes=cycle,
        )


def apply_orders(graph: Graph, orders: Sequence[Order]) -> Graph:
    """``orders`` applied in turn, with one cycle search for all of them.

    Errors are those of applying them one by one: when the orders together make a cycle, or
    an order's slots fail to match, the orders before are replayed one at a time so the
    first offending ``Order`` is the one named.
    """
    if not orders:
        return graph
    _check_placed(orders[0], graph)
    added: list[list[Edge]] = []
    node_index = _node_index(graph)  # every Order sees the same nodes: index them once
    for k, order in enumerate(orders):
        try:
            added.append(order._edges(graph, node_index))
        except DirectiveError:
            _replay(graph, orders[:k], added)  # an earlier cycle is the first error
            raise
    result = attrs.evolve(graph, edges=graph.edges + tuple(e for edges in added for e in edges))
    if find_cycle(result) is not None:
        _replay(graph, orders, added)
    return result


def _replay(graph: Graph, orders: Sequence[Order], added: list[list[Edge]]) -> None:
    """Raise the cycle error of the first of ``orders`` that closes a cycle, if any."""
    for order, edges in zip(orders, added, strict=False):
        graph = attrs.evolve(graph, edges=graph.edges + tuple(edges))
        cycle = find_cycle(graph)
        if cycle is not None:
            raise order._cycle_error(cycle)


def _check_placed(order: Order, graph: Graph) -> None:
    if not graph.world_size:
        raise DirectiveError("Order needs a placed graph: put Place directives before it", directive=str(order))


def candidates(flt: Filter, index: Buckets, everything: Sequence[Node]) -> Sequence[Node]:
    """The nodes of ``everything`` that ``flt`` may match, from its narrowest bucket in
    ``index`` (``bucket_nodes(everything)``); every node when the filter names no exact
    pass and microbatch. The caller still tests each with ``flt.matches``."""
    key, _ = _bucket(flt)
    return everything if key is None else index.get(key, [])


def matching(flt: Filter, index: Buckets, everything: Sequence[Node]) -> Sequence[Node]:
    """The nodes of ``everything`` that ``flt`` matches, in their order: ``candidates``,
    each tested with ``flt.matches`` unless the bucket holds only matches (a filter of a
    pass, a microbatch and at most one tag: every slot of the built-in schedules)."""
    key, exact = _bucket(flt)
    if key is None:
        return [n for n in everything if flt.matches(n)]
    found = index.get(key, [])
    return found if exact else [n for n in found if flt.matches(n)]


def _bucket(flt: Filter) -> tuple[tuple | None, bool]:
    """The key of ``flt``'s narrowest bucket in ``bucket_nodes`` (None: it names no exact pass
    and microbatch, so every node is a candidate), and whether every node of that bucket
    matches ``flt`` (the key holds all of its items)."""
    # Only exact values index a bucket: "*" and sets of values (tuples) scan every node. The
    # filter's items are sorted by key, so ``other`` is the first other exact key, and its
    # bucket the narrowest an exact key allows. Buckets keep graph order, so the matches come
    # out in the order a scan of every node gives, and so do the edges. (One loop over the
    # items, no dictionaries: this runs once per slot, 132k times at 16,384 devices.)
    phase = mb = other = None
    exact = True
    for key, want in flt.items:
        if want == "*" or isinstance(want, tuple):
            exact = False  # a wildcard still asks for the tag; a set is not a bucket
            continue
        if key == "PASS":
            phase = want
        elif key == "MB":
            mb = want
        elif other is None:
            other = (key, want)
        else:
            exact = False
    if phase is None or mb is None:
        return None, False
    if other is None:
        return (phase, mb), exact
    # a tag named SEG shares its bucket with the segment ids, which the filter's SEG means
    return (phase, mb, *other), exact and other[0] != "SEG"


def _node_index(graph: Graph) -> tuple[Buckets, list[Node]]:
    """Orderable nodes in graph order, and ``bucket_nodes`` of them."""
    orderable = [n for n in graph.nodes if n.kind in ORDERABLE]
    return bucket_nodes(orderable), orderable


def bucket_nodes(nodes: Sequence[Node]) -> Buckets:
    """``nodes`` bucketed by (PASS, MB) and by (PASS, MB, key, value) for ``SEG`` and each
    tag, each bucket in the order of ``nodes``: what ``candidates`` looks filters up in."""
    return Buckets(nodes)


class Buckets:
    """``bucket_nodes``: a table with ``get(key, default)``, whose buckets of one kind (plain
    (PASS, MB), ``SEG``, or one tag) are made the first time a key of that kind is asked
    for. A schedule's filters name one tag (``PP``): making the (PASS, MB) and ``SEG``
    buckets too was two thirds of the table (131k nodes at 16,384 devices)."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = nodes
        self.index: dict[tuple, list[Node]] = {}
        self.made: set[str | None] = set()  # kinds made: None for (PASS, MB), "SEG", tag names

    def get(self, key: tuple, default: list[Node] | None = None) -> list[Node] | None:
        kind = key[2] if len(key) > 2 else None
        if kind not in self.made:
            self._make(kind)
        return self.index.get(key, default)

    def _make(self, kind: str | None) -> None:
        self.made.add(kind)
        index = self.index
        get, phase_value = index.get, PHASE_VALUES.get

        def add(key: tuple, n: Node) -> None:
            bucket = get(key)
            if bucket is None:
                index[key] = [n]
            else:
                bucket.append(n)

        for n in self.nodes:
            if kind is None:
                add((phase_value(n.phase), n.microbatch), n)
                continue
            if kind == SEG and n.segment is not None:  # a tag named SEG shares these buckets
                add((phase_value(n.phase), n.microbatch, SEG, n.segment), n)
            for key, val in n.tags.items:
                if key == kind:
                    add((phase_value(n.phase), n.microbatch, key, val), n)
