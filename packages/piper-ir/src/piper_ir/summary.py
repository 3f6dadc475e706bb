"""Human-readable summaries of graphs and programs (one line per node or instruction)."""

from __future__ import annotations

from collections import Counter

from piper_ir.graph import Graph
from piper_ir.program import Program


def graph_summary(graph: Graph) -> str:
    kinds = Counter(n.kind.value for n in graph.nodes)
    lines = [
        f"graph: {len(graph.segments)} segments, {len(graph.nodes)} nodes, {len(graph.edges)} edges, "
        f"{graph.microbatches} microbatches, world size {graph.world_size or '-'}",
        "  nodes by kind: " + ", ".join(f"{k}={v}" for k, v in sorted(kinds.items())),
    ]
    if graph.precision is not None:
        lines.append(f"  precision: compute {graph.precision.compute}, master {graph.precision.master}")
    for seg in graph.segments:
        recompute = " recompute" if seg.recompute else ""
        lines.append(
            f"  segment {seg.id} [{seg.role.value}]{recompute} tags({seg.tags}) in={list(seg.inputs)} out={list(seg.outputs)}"
        )
    for tie in graph.ties:
        lines.append(f"  tie {tie.name}: " + ", ".join(f"{seg}:{name}" for seg, name in tie.holders))
    return "\n".join(lines)


def program_text(program: Program, *, width: int = 14) -> str:
    """A rank x step grid of instruction labels, like torch's pipelining schedule dumps."""
    columns = [[ins.short() for ins in plan.instructions] for plan in program.ranks]
    steps = max((len(c) for c in columns), default=0)
    header = "step  " + "".join(f"rank {r:<{width - 5}}" for r in range(len(columns)))
    rows = [header]
    for i in range(steps):
        cells = [(c[i] if i < len(c) else "")[: width - 1].ljust(width) for c in columns]
        rows.append(f"{i:<5} " + "".join(cells))
    return "\n".join(rows)
