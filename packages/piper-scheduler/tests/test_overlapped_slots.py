"""``compile._overlapped_slots`` looks at the ordered edges around the few nodes that can
share a slot (``forks`` and ``joins``): it finds what the search over every ordered edge's
neighbour sets finds, on every library schedule, with the loss sharing the last stage's slots
and with DualPipe's overlapped F&B pairs."""

from __future__ import annotations

import pytest

from piper_directives import build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_ir import EdgeKind, Graph, NodeKind, Phase
from piper_scheduler.compile import OVERLAP_PHASES, _overlapped_slots


def _every_edge(graph: Graph) -> dict[str, tuple]:
    """The search as it was: the ordered neighbour sets of every node, a key per node that
    shares its slot."""
    preds: dict[str, set[str]] = {}
    succs: dict[str, set[str]] = {}
    for e in graph.edges:
        if e.kind is EdgeKind.TEMPORAL and e.origin is not None:
            preds.setdefault(e.dst, set()).add(e.src)
            succs.setdefault(e.src, set()).add(e.dst)
    groups: dict[tuple, list] = {}
    for n in graph.nodes:
        if n.kind is NodeKind.COMPUTE and n.phase in OVERLAP_PHASES and (n.id in preds or n.id in succs):
            before, after = preds.get(n.id), succs.get(n.id)
            if len(succs[next(iter(before))] if before else preds[next(iter(after))]) == 1:
                continue
            key = (n.devices, frozenset(before or ()), frozenset(after or ()))
            groups.setdefault(key, []).append(n)
    out: dict[str, tuple] = {}
    for key, members in groups.items():
        phases = {n.phase for n in members}
        if Phase.F in phases and phases & {Phase.B, Phase.BI}:
            out.update((n.id, key) for n in members)
    return out


@pytest.mark.parametrize(
    ("name", "pp", "microbatches", "regions"),
    [("1f1b", 4, 8, 4), ("gpipe", 3, 4, 3), ("zb1p", 4, 8, 4), ("interleaved_1f1b", 2, 4, 4),
     ("dualpipev", 2, 4, 4), ("dualpipev", 4, 8, 8), ("dualpipe", 4, 8, 4)],
)
def test_the_slots_found_are_those_of_every_edge(name: str, pp: int, microbatches: int, regions: int) -> None:
    graph = build_schedule(name, pp, microbatches).apply(synthetic_graph(regions, microbatches, 1, hidden=4))
    found = _overlapped_slots(graph)
    assert found == _every_edge(graph)
    assert bool(found) == name.startswith("dualpipe")  # the loss's slots hold no F&B pair
