"""``Order``: fix the order of compute on each device with temporal edges.

``Order(slots)`` takes a list of slots; each slot is a list of filters (one filter is the
common case). On every device, each node matched by slot ``k`` gets a temporal edge to each
node matched by the next slot ``k' > k`` that matches nodes on that device. Nodes of one
slot stay unordered relative to each other: the scheduler may interleave them (DualPipe's
overlapped forward and backward). Only compute and optimizer nodes are ordered.

Requires a placed graph. Guarantees: the result is acyclic, or a ``DirectiveError`` names
this directive, where it was written, and the nodes of the cycle.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import attrs

from piper_directives.source import user_location
from piper_ir import DirectiveError, Edge, EdgeKind, Filter, Graph, NodeKind, find_cycle


def _to_slots(value: Sequence) -> tuple[tuple[Filter, ...], ...]:
    slots = []
    for slot in value:
        if isinstance(slot, Filter | dict):
            slot = [slot]
        slots.append(tuple(f if isinstance(f, Filter) else Filter.of(f) for f in slot))
    return tuple(slots)


@attrs.frozen
class Order:
    slots: tuple[tuple[Filter, ...], ...] = attrs.field(converter=_to_slots)
    name: str = "Order"
    where: str = attrs.field(factory=user_location, eq=False)

    def __str__(self) -> str:
        return f"{self.name}({len(self.slots)} slots) at {self.where}"

    def apply(self, graph: Graph) -> Graph:
        if not graph.world_size:
            raise DirectiveError("Order needs a placed graph: put Place directives before it", directive=str(self))
        orderable = [n for n in graph.nodes if n.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER)]
        # Index by (PASS, MB) so the usual exact filters do not scan every node.
        index: dict[tuple[object, object], list] = defaultdict(list)
        for n in orderable:
            index[(n.phase.value if n.phase else None, n.microbatch)].append(n)
        slot_of: dict[str, int] = {}
        per_device: dict[int, list[list[str]]] = defaultdict(list)
        for k, slot in enumerate(self.slots):
            matched = [n for f in slot for n in _candidates(f, index, orderable) if f.matches(n)]
            if not matched:
                shown = ", ".join(map(str, slot))
                raise DirectiveError(f"slot {k} ({shown}) matches no compute node", directive=str(self))
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
        origin = str(self)
        new_edges = []
        for slots in per_device.values():
            for before, after in zip(slots, slots[1:], strict=False):
                new_edges.extend(Edge(a, b, EdgeKind.TEMPORAL, origin=origin) for a in before for b in after)
        result = attrs.evolve(graph, edges=graph.edges + tuple(new_edges))
        cycle = find_cycle(result)
        if cycle is not None:
            raise DirectiveError(
                "this order contradicts the data flow or an earlier order; it creates the cycle "
                + " -> ".join(cycle),
                directive=origin,
                nodes=cycle,
            )
        return result


def _candidates(flt: Filter, index: dict, everything: list) -> list:
    keys = flt.as_dict()
    phase, mb = keys.get("PASS"), keys.get("MB")
    if phase is None or mb is None or "*" in (phase, mb):
        return everything
    return index.get((phase, mb), [])
