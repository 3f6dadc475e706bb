"""Export a ``Timeline``: Chrome/Perfetto trace JSON and a pipeline-paper style Gantt PNG."""

from __future__ import annotations

from math import gcd
from pathlib import Path
from typing import Any

from piper_ir import NodeKind, Phase
from piper_scheduler.timeline import Timeline

# Forward orange, full backward green, its halves blue (to inputs, light) and purple (to
# weights), as pipeline papers draw them; a rank's second chunk (the other direction of a V,
# a later virtual stage) is a darker shade of the same colour.
PHASE_COLORS = {
    Phase.F: "#F5A742",
    Phase.B: "#5DB85D",
    Phase.BI: "#6FA8DC",
    Phase.BW: "#9A7FD1",
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


def _darker(color: str, amount: float) -> tuple[float, float, float]:
    rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return (rgb[0] * (1 - amount), rgb[1] * (1 - amount), rgb[2] * (1 - amount))


def _chunks(timeline: Timeline) -> dict[tuple[int, str], int]:
    """(rank, segment) -> chunk, the stage chunk a segment belongs to on its rank.

    Segments are ``s<k>`` in chain order. A rank's segments fall into runs of consecutive
    numbers; the chunk size is the gcd of all run lengths over all ranks (a run longer than
    that, like stages 3 and 4 on the turning rank of a V, holds several chunks). A V
    placement or interleaving thus gives two or more chunks; the loss joins the last one.
    """
    numbers: dict[int, list[int]] = {}
    for iv in timeline.intervals:
        if iv.segment and iv.segment[0] == "s" and iv.segment[1:].isdigit():
            numbers.setdefault(iv.rank, []).append(int(iv.segment[1:]))
    runs: dict[int, list[list[int]]] = {}
    for rank, nums in numbers.items():
        for k in sorted(set(nums)):
            rank_runs = runs.setdefault(rank, [])
            if rank_runs and rank_runs[-1][-1] == k - 1:
                rank_runs[-1].append(k)
            else:
                rank_runs.append([k])
    size = 0
    for rank_runs in runs.values():
        for run in rank_runs:
            size = gcd(size, len(run))
    out: dict[tuple[int, str], int] = {}
    for rank, rank_runs in runs.items():
        chunk = 0
        for run in rank_runs:
            for j, k in enumerate(run):
                out[(rank, f"s{k}")] = chunk + j // size
            chunk += len(run) // size
        out[(rank, "loss")] = out[(rank, f"s{rank_runs[-1][-1]}")]
    return out


def _boxes(timeline: Timeline, chunks: dict[tuple[int, str], int]) -> list[dict[str, Any]]:
    """Compute intervals merged into one box per (rank, phase, microbatch, chunk) run, so a
    stage of several segments (or a stage with the loss) is drawn as one cell."""
    boxes: list[dict[str, Any]] = []
    last: dict[int, dict[str, Any]] = {}
    ordered = sorted(
        (iv for iv in timeline.intervals if iv.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER) and iv.duration > 0),
        key=lambda iv: (iv.rank, iv.start),
    )
    for iv in ordered:
        chunk = chunks.get((iv.rank, iv.segment or ""), 0)
        phase = Phase.B if iv.segment == "loss" and iv.phase is Phase.BI else iv.phase
        prev = last.get(iv.rank)
        if (
            prev is not None
            and abs(prev["end"] - iv.start) < 1e-9
            and (prev["phase"], prev["mb"], prev["overlap"]) == (phase, iv.microbatch, iv.overlap)
            and (prev["chunk"] == chunk or iv.segment == "loss")
        ):
            prev["end"] = iv.end
            continue
        box = {"rank": iv.rank, "start": iv.start, "end": iv.end, "phase": phase, "mb": iv.microbatch,
               "chunk": chunk, "overlap": iv.overlap}
        boxes.append(box)
        last[iv.rank] = box
    return boxes


def plot_gantt(
    timeline: Timeline, path: str | Path, *, title: str | None = None, unit: str = "cost units"
) -> Path:
    """Write a PNG Gantt chart in the style of pipeline papers (DualPipe, zero bubble).

    One row per rank; one box per stage chunk, coloured by pass (F, B, BI, BW, OPT) and
    labelled with its microbatch; a rank's second chunk (the other direction of a V, or a
    later virtual stage) in a darker shade. An overlapped F&B slot is one outlined cell,
    forward on top and backward below. Non-empty transfers are a thin strip under a row.

    Needs matplotlib (``pip install piper-scheduler[plot]``).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    ranks = timeline.world_size
    span = max(timeline.makespan, 1e-9)
    chunks = _chunks(timeline)
    boxes = _boxes(timeline, chunks)
    shortest = min((b["end"] - b["start"] for b in boxes), default=1.0)
    # about 0.24 inch for the shortest box, so its label fits; 8 to 26 inches wide
    width = min(26.0, max(8.0, 0.24 * span / max(shortest, 1e-9) + 1.5))
    fig, ax = plt.subplots(figsize=(width, 0.55 * ranks + 1.3))
    fontsize = 7 if width < 20 else 6

    def color(box: dict[str, Any]) -> Any:
        base = PHASE_COLORS.get(box["phase"], "#CCCCCC") if box["phase"] else "#CCCCCC"
        return _darker(base, 0.32 * min(box["chunk"], 2))

    def label(x: float, y: float, box: dict[str, Any]) -> None:
        if box["mb"] is None:
            return
        text = "white" if box["chunk"] else "black"
        ax.text(x, y, str(box["mb"]), ha="center", va="center", fontsize=fontsize, color=text)

    pairs: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for box in boxes:
        if box["overlap"] is not None:
            pairs.setdefault((box["rank"], box["overlap"]), []).append(box)
            continue
        y = ranks - 1 - box["rank"]
        ax.add_patch(Rectangle((box["start"], y - 0.4), box["end"] - box["start"], 0.8, facecolor=color(box),
                               edgecolor="black", linewidth=0.4))
        label((box["start"] + box["end"]) / 2, y, box)
    for (rank, _), members in sorted(pairs.items()):
        y = ranks - 1 - rank
        start, end = min(b["start"] for b in members), max(b["end"] for b in members)
        forward = [b for b in members if b["phase"] is Phase.F]
        backward = [b for b in members if b["phase"] is not Phase.F]
        for half, top in ((forward, True), (backward, False)):
            if not half:
                continue
            box = half[0]
            y0 = y if top else y - 0.4
            ax.add_patch(Rectangle((start, y0), end - start, 0.4, facecolor=color(box), edgecolor="none"))
            label((start + end) / 2, y0 + 0.2, box)
        ax.add_patch(Rectangle((start, y - 0.4), end - start, 0.8, fill=False, edgecolor="black", linewidth=1.3))
    for iv in timeline.intervals:
        if iv.kind not in (NodeKind.COMPUTE, NodeKind.OPTIMIZER) and iv.duration > 0:
            y = ranks - 1 - iv.rank
            ax.add_patch(Rectangle((iv.start, y - 0.48), iv.duration, 0.06, facecolor="#E0A800", edgecolor="none"))
    ax.set_ylim(-0.6, ranks - 0.4)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {ranks - 1 - y}" for y in range(ranks)])
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or f"makespan {timeline.makespan:g}", loc="left", fontsize=9)
    names = {Phase.F: "forward", Phase.B: "backward", Phase.BI: "backward to inputs", Phase.BW: "backward to weights",
             Phase.OPT: "optimizer"}
    used = {b["phase"] for b in boxes}
    handles = [Patch(facecolor=c, edgecolor="black", linewidth=0.4, label=names[p])
               for p, c in PHASE_COLORS.items() if p in used]
    if any(b["chunk"] for b in boxes):
        handles.append(Patch(facecolor=_darker(PHASE_COLORS[Phase.F], 0.32), edgecolor="black", linewidth=0.4,
                             label="darker: a rank's next stage chunk (in a V: the way back)"))
    if pairs:
        handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.3, label="overlapped F&B (F top, B bottom)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, -0.5 / (0.55 * ranks + 0.3)),
              ncol=len(handles), fontsize=7, frameon=False)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out
