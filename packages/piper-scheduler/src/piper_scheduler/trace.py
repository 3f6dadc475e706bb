"""Export a ``Timeline``: Chrome/Perfetto trace JSON and a pipeline-paper style Gantt PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from piper_ir import NodeKind, Phase
from piper_scheduler.timeline import Timeline

PHASE_COLORS = {
    Phase.F: "#4C8BF5",
    Phase.B: "#34A853",
    Phase.BI: "#7CC68D",
    Phase.BW: "#1E6B34",
    Phase.OPT: "#9E9E9E",
}


def to_chrome_trace(timeline: Timeline, *, us_per_unit: float = 1000.0) -> dict[str, Any]:
    """A Chrome trace (``chrome://tracing``, Perfetto): pid = rank, tid = stream.

    Every instruction becomes a complete event (``"ph": "X"``); ``ts`` and ``dur`` are in
    microseconds, ``us_per_unit`` per cost unit (one unit shows as one millisecond).
    """
    events: list[dict[str, Any]] = []
    for rank in range(timeline.world_size):
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        )
    tids = _thread_ids(timeline)
    for (rank, stream), tid in tids.items():
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": stream}})
    for iv in timeline.intervals:
        key = (iv.rank, iv.stream)
        args: dict[str, Any] = {"id": iv.instruction}
        if iv.microbatch is not None:
            args["microbatch"] = iv.microbatch
        events.append(
            {
                "name": iv.label,
                "cat": iv.kind.value,
                "ph": "X",
                "pid": iv.rank,
                "tid": tids[key],
                "ts": iv.start * us_per_unit,
                "dur": (iv.end - iv.start) * us_per_unit,
                "args": args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _thread_ids(timeline: Timeline) -> dict[tuple[int, str], int]:
    """Per rank, tid 0 for the ``compute`` stream, then the others in order of first use."""
    streams: dict[int, dict[str, None]] = {r: {"compute": None} for r in range(timeline.world_size)}
    used: set[tuple[int, str]] = set()
    for iv in timeline.intervals:
        streams[iv.rank].setdefault(iv.stream, None)
        used.add((iv.rank, iv.stream))
    tids: dict[tuple[int, str], int] = {}
    for rank, names in streams.items():
        for tid, name in enumerate(n for n in names if (rank, n) in used):
            tids[(rank, name)] = tid
    return tids


def plot_gantt(timeline: Timeline, path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG Gantt chart: one row per rank, compute boxes coloured by phase and
    labelled with their microbatch; non-empty transfers as a thin strip under each row.

    Needs matplotlib (``pip install piper-scheduler[plot]``).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = timeline.world_size
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, timeline.makespan * 0.4 + 2)), 0.6 * ranks + 1.2))
    for iv in timeline.intervals:
        y = ranks - 1 - iv.rank
        if iv.duration <= 0:
            continue
        if iv.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER):
            color = PHASE_COLORS.get(iv.phase, "#CCCCCC") if iv.phase else "#CCCCCC"
            ax.broken_barh(
                [(iv.start, iv.duration)], (y - 0.4, 0.8), facecolors=color, edgecolors="black", linewidth=0.5
            )
            if iv.microbatch is not None:
                ax.text(
                    iv.start + iv.duration / 2, y, str(iv.microbatch), ha="center", va="center", fontsize=8
                )
        else:
            ax.broken_barh([(iv.start, iv.duration)], (y - 0.48, 0.06), facecolors="#F4B400")
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {ranks - 1 - y}" for y in range(ranks)])
    ax.set_xlim(0, max(timeline.makespan, 1e-9))
    ax.set_xlabel("time (cost units)")
    ax.set_title(title or f"makespan {timeline.makespan:g}", loc="left")
    used = {iv.phase for iv in timeline.intervals if iv.phase is not None and iv.duration > 0}
    ax.legend(
        handles=[Patch(color=c, label=p.value) for p, c in PHASE_COLORS.items() if p in used],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=len(PHASE_COLORS),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
