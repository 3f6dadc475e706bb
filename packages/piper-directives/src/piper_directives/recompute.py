"""``Recompute``: drop a region's activations after its forward, recompute them for its backward.

``Recompute(filter)`` marks every stage segment whose tags match ``filter`` with
``Segment.recompute``: its forward keeps only its inputs, and its backward first runs the
forward again (drawing the same random numbers, in the same dtypes), so the gradients are
the ones without recomputation while a rank holds a segment's activations for one
microbatch at a time instead of for every microbatch in flight. ``torch.utils.checkpoint``
in the user's code marks its segment the same way at capture.

``recompute_all(graph, recomputes)`` is the Recompute phase of ``Strategy.apply``: after
Split, before Place (it changes segments, not nodes). Requires a captured graph. Guarantees:
every matched stage segment has ``recompute=True``, the others keep what capture recorded; a
filter that matches no region, or only the loss, is a ``DirectiveError`` naming the
directive. A recomputed segment's memory is accounted for by ``piper_memory.estimate_memory``
(its inputs between the passes, its activations only while its backward runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs

from piper_directives.common import JsonObject, filter_from_json, to_filter, user_location
from piper_directives.groups import segment_matches
from piper_ir import DirectiveError, Filter, Graph, SegmentRole


@attrs.frozen
class Recompute:
    """Recompute the activations of the regions ``filter`` matches in their backward."""

    op: ClassVar[str] = "recompute"

    filter: Filter = attrs.field(converter=to_filter)
    where: str = attrs.field(factory=user_location, eq=False)

    def __str__(self) -> str:
        return f"Recompute({self.filter}) at {self.where}"

    def to_json(self) -> JsonObject:
        return {"op": self.op, "filter": self.filter.as_dict()}

    @classmethod
    def from_json(cls, item: JsonObject, where: str) -> Recompute:
        return cls(filter_from_json(item["filter"], where), where=where)


def recompute_all(graph: Graph, recomputes: Sequence[Recompute]) -> Graph:
    """``graph`` with ``Segment.recompute`` set on the stage segments each directive matches."""
    if not recomputes:
        return graph
    marked: set[str] = set()
    for directive in recomputes:
        matched = [
            s.id for s in graph.segments if s.role is SegmentRole.STAGE and segment_matches(directive.filter, s)
        ]
        if not matched:
            raise DirectiveError(f"filter {directive.filter} matches no annotated region", directive=str(directive))
        marked.update(matched)
    segments = tuple(attrs.evolve(s, recompute=True) if s.id in marked else s for s in graph.segments)
    return attrs.evolve(graph, segments=segments)
