"""Compile time at scale: apply -> compile -> memory on synthetic pipelines up to 16,384 devices.

Each configuration is PP pipeline ranks x DP data-parallel replicas, M microbatches and S
segments per pipeline stage, scheduled with 1F1B. Data-parallel replicas run the same plan on
other devices, so the compiler works on one replica's pipeline: the work grows with
PP x M x S (nodes and edges), not with the device count PP x DP. Stages timed:

- the phases of ``Strategy.apply`` (``Strategy.phases``, timed one by one, with the collector
  paused as ``apply`` pauses it): ``split``; ``place`` (recompute, place, shard, replicate and
  the communication the placement needs); ``split B`` (which backwards the Orders split:
  none in 1F1B, but every backward slot is looked at); ``order`` (every Order through
  ``apply_orders``: one cycle search for all of them); ``validate``;
- ``compile``: ``compile_program`` (it validates its input and verifies its output);
- ``verify``: ``verify`` alone on the compiled program (already included in ``compile``);
- ``memory``: ``piper_memory.estimate_memory`` on the program;
- ``json``: ``piper_ir.to_json`` of the program, what ``piper plan --out`` writes (not in the
  total: a plan used in the same process is never written);
- ``probe``: one lookup of each edge's two ends in the ordered graph's node table, the least
  any pass over the edges does (not in the total). Its growth per 4x of the graph is what the
  machine adds to every such pass: at 392k nodes the table, the id strings and the edges
  outgrow the CPU's caches, so a lookup costs twice what it costs at 98k nodes.

Each configuration runs in a fresh Python process, so its peak resident memory
(``ru_maxrss``: interpreter, graphs, program) is its own and no configuration inherits another's
heap. ``cpu s`` is the process CPU time of the timed stages: on a shared machine it moves less
than wall time. The machine's load (``/proc/loadavg``) is recorded before and after the run.
``--repeat N`` runs each configuration N times (each in a fresh process) and keeps the row of
its fastest run (smallest total), so a stall of a shared machine does not land in the table.
``--clock cpu`` puts each stage's CPU seconds in the table instead of its wall seconds (and
picks the fastest run by them): on a machine other jobs keep busy, wall seconds measure the
queue for a CPU as much as the compiler.

No torch is imported. Prints a Markdown table; writes it to ``docs/compile-scaling.md`` and a
log-log plot to ``docs/compile-scaling.png``.

    .venv/bin/python benchmarks/bench_compile.py            # the full table (a few minutes)
    .venv/bin/python benchmarks/bench_compile.py --quick    # the small configurations only
    .venv/bin/python benchmarks/bench_compile.py --repeat 3 --clock cpu  # a shared machine
    .venv/bin/python benchmarks/bench_compile.py --digests  # the plans' sha256, before and after a change
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from piper_directives.schedules import build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_ir import Graph, gc_paused, to_json
from piper_memory import estimate_memory
from piper_scheduler import compile_program, verify

ROOT = Path(__file__).resolve().parent.parent

# (PP, DP, microbatches, segments per stage)
CONFIGS = [
    (4, 4, 16, 1),
    (8, 8, 32, 1),
    (16, 16, 64, 1),
    (32, 32, 128, 1),
    (64, 64, 256, 1),
    (64, 64, 256, 2),
    (128, 128, 512, 1),
]
QUICK = CONFIGS[:3]
STAGES = ("split", "place", "split B", "order", "validate", "compile", "verify", "memory", "json", "probe")
NOT_IN_TOTAL = ("verify", "json", "probe")  # verify runs inside compile; the others are no compile's work
# Strategy.phases() -> column: the phases that place and connect the graph share one column
# (recompute, shard, context parallelism and replicate have no directive here and return the
# graph as it is).
PHASE_COLUMNS = {"recompute": "place", "shard": "place", "context": "place", "replicate": "place",
                 "context records": "place", "communication": "place", "split backward": "split B"}


def run(pp: int, dp: int, m: int, s: int, schedule: str = "1f1b") -> dict:
    base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux: imports alone
    graph = synthetic_graph(pp, m, s, hidden=1024, batch=1)
    strategy = build_schedule(schedule, pp, m)
    times: dict[str, float] = {}
    cpu_times: dict[str, float] = {}

    def timed(name: str, fn, *args):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn(*args)
        times[name] = times.get(name, 0.0) + time.perf_counter() - t0
        cpu_times[name] = cpu_times.get(name, 0.0) + time.process_time() - c0
        return out

    g = graph
    with gc_paused():  # as Strategy.apply runs them
        for name, phase in strategy.phases():
            g = timed(PHASE_COLUMNS.get(name, name), phase, g)
    program = timed("compile", compile_program, g)
    timed("verify", verify, program)
    timed("memory", estimate_memory, program)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the JSON text exists
    text = timed("json", to_json, program)
    timed("probe", probe, g)
    total = sum(v for k, v in times.items() if k not in NOT_IN_TOTAL)
    cpu = sum(v for k, v in cpu_times.items() if k not in NOT_IN_TOTAL)
    return {
        "pp": pp, "dp": dp, "devices": pp * dp, "microbatches": m, "segments": s,
        "nodes": len(g.nodes), "edges": len(g.edges),
        "instructions": sum(len(p.instructions) for p in program.ranks), "json_mb": len(text) / 2**20,
        **times, "total": total, "cpu": cpu, **{f"{k} cpu": v for k, v in cpu_times.items()},
        "peak_mb": peak_mb, "base_mb": base_mb,
    }


# (label, schedule, pipeline ranks, microbatches, regions, segments per region) of ``--digests``:
# the small configurations of the table, then a library schedule of each kind
DIGEST_CASES = [
    *((f"1f1b {pp} x {dp}, M={m}", "1f1b", pp, m, pp, s) for pp, dp, m, s in QUICK),
    ("1f1b 16 x 16, M=64, 2 segments/stage", "1f1b", 16, 64, 16, 2),
    ("gpipe 4, M=8", "gpipe", 4, 8, 4, 1),
    ("zb1p 4, M=8", "zb1p", 4, 8, 4, 1),
    ("interleaved_1f1b 4, M=8, 8 stages", "interleaved_1f1b", 4, 8, 8, 1),
    ("dualpipev 4, M=8", "dualpipev", 4, 8, 8, 1),
    ("dualpipe 4, M=8", "dualpipe", 4, 8, 4, 1),
]


def digests() -> list[tuple[str, str]]:
    """(label, sha256 of ``to_json`` of the compiled program) for ``DIGEST_CASES``: a change to
    the compiler's speed must leave every one of them as it was."""
    out = []
    for label, name, pp, m, regions, s in DIGEST_CASES:
        strategy = build_schedule(name, pp, m, stages=None if regions == pp else regions)
        program = compile_program(strategy.apply(synthetic_graph(regions, m, s, hidden=1024, batch=1)))
        out.append((label, hashlib.sha256(to_json(program).encode()).hexdigest()))
    return out


def probe(graph: Graph) -> None:
    """Look up both ends of every edge in ``graph.node_by_id`` (built before, untimed): the
    floor of a pass over the edges."""
    nodes = graph.node_by_id
    for e in graph.edges:
        nodes[e.src]
        nodes[e.dst]


def run_isolated(cfg: tuple[int, int, int, int], no_gc: bool) -> dict:
    """``run(*cfg)`` in a fresh interpreter: its peak memory is this configuration's alone."""
    cmd = [sys.executable, __file__, "--row", *map(str, cfg), *(["--no-gc"] if no_gc else [])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def on_cpu_clock(row: dict) -> dict:
    """``row`` with its stage columns and ``total`` in CPU seconds, ``cpu`` holding the wall total
    (``--clock cpu``)."""
    return {**row, **{k: row[f"{k} cpu"] for k in STAGES}, "total": row["cpu"], "cpu": row["total"]}


def table(rows: list[dict], other: str = "cpu") -> str:
    """``other``: what the column after the total holds (``cpu`` seconds, or ``wall`` seconds
    when the stages are CPU seconds)."""
    head = ("| devices (PP x DP) | M | seg/stage | nodes | edges | " + " | ".join(STAGES)
            + f" | total s | {other} s | peak MB |")
    lines = [head, "|" + "---|" * (8 + len(STAGES))]
    for r in rows:
        cells = [f"{r['devices']:,} ({r['pp']} x {r['dp']})", str(r["microbatches"]), str(r["segments"]),
                 f"{r['nodes']:,}", f"{r['edges']:,}", *(f"{r[k]:.2f}" for k in STAGES), f"**{r['total']:.2f}**",
                 f"{r['cpu']:.2f}", f"{r['peak_mb']:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def growth(rows: list[dict], other: str = "cpu") -> str:
    """Each one-segment row against the previous one: how much the graph and the times grew
    (``other``: the total on the other clock, as in ``table``)."""
    sel = [r for r in rows if r["segments"] == 1]
    lines = [f"| devices | graph (nodes + edges) | compile | total | total {other} | probe | peak memory |",
             "|---|---|---|---|---|---|---|"]
    for a, b in zip(sel, sel[1:], strict=False):
        size = (b["nodes"] + b["edges"]) / (a["nodes"] + a["edges"])
        lines.append(f"| {a['devices']:,} -> {b['devices']:,} | x{size:.2f} | x{b['compile'] / a['compile']:.2f} | "
                     f"x{b['total'] / a['total']:.2f} | x{b['cpu'] / a['cpu']:.2f} | {ratio(b['probe'], a['probe'])} | "
                     f"x{b['peak_mb'] / a['peak_mb']:.2f} |")
    return "\n".join(lines)


def ratio(b: float, a: float) -> str:
    """``b / a`` as a growth cell; a dash when ``a`` is below the clock's resolution."""
    return f"x{b / a:.2f}" if a > 0 else "-"


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def plot(rows: list[dict], path: Path, ylabel: str = "seconds") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for s in sorted({r["segments"] for r in rows}):
        sel = [r for r in rows if r["segments"] == s]
        x = [r["nodes"] + r["edges"] for r in sel]
        ax.loglog(x, [r["total"] for r in sel], "o-", label=f"total, {s} segment(s)/stage")
        ax.loglog(x, [r["compile"] for r in sel], "s--", alpha=0.7, label=f"compile, {s} segment(s)/stage")
        for r in sel:
            ax.annotate(f"{r['devices']} dev", (r["nodes"] + r["edges"], r["total"]), fontsize=7,
                        textcoords="offset points", xytext=(4, -10))
    lo = min(r["nodes"] + r["edges"] for r in rows)
    ref = min(rows, key=lambda r: r["nodes"] + r["edges"])
    hi = max(r["nodes"] + r["edges"] for r in rows)
    ax.loglog([lo, hi], [ref["total"], ref["total"] * hi / lo], ":", color="gray", label="linear")
    ax.axhline(6, color="red", lw=0.8, label="6 s target (16,384 devices)")
    ax.set_xlabel("graph size (nodes + edges)")
    ax.set_ylabel(ylabel)
    ax.set_title("Piper compile time, 1F1B, synthetic pipeline", loc="left")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the three small configurations, no files written")
    parser.add_argument("--no-gc", action="store_true", help="disable Python's cyclic garbage collector while timing")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run each configuration N times and keep its fastest run (default 1)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="what the stage columns and the total measure: wall seconds (default) or the process's "
                        "CPU seconds, which a shared machine's other jobs move less")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where to write compile-scaling.{md,png}")
    parser.add_argument("--digests", action="store_true",
                        help="print the sha256 of the compiled program's JSON for the small configurations and a "
                        "plan of each library schedule, and stop: what a change to the compiler's speed must keep")
    parser.add_argument("--row", type=int, nargs=4, metavar=("PP", "DP", "M", "S"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.digests:
        for label, digest in digests():
            print(f"{digest}  {label}")
        return
    if args.row:  # one configuration, in this process: print its row as JSON
        gc.collect()
        if args.no_gc:
            gc.disable()
        print(json.dumps(run(*args.row)))
        return
    rows = []
    load_before = load()
    for cfg in QUICK if args.quick else CONFIGS:
        runs = [run_isolated(cfg, args.no_gc) for _ in range(max(1, args.repeat))]
        if args.clock == "cpu":
            runs = [on_cpu_clock(r) for r in runs]
        rows.append(min(runs, key=lambda r: r["total"]))
        r = rows[-1]
        print(f"PP={r['pp']:>3} DP={r['dp']:>3} M={r['microbatches']:>4} S={r['segments']}: "
              f"{r['nodes']:>8,} nodes {r['edges']:>8,} edges  compile {r['compile']:6.2f} s  "
              f"total {r['total']:6.2f} s  peak {r['peak_mb']:6.0f} MB", flush=True)
    load_after = load()
    other = "wall" if args.clock == "cpu" else "cpu"
    text, grew = table(rows, other), growth(rows, other)
    print()
    print(text)
    print()
    print(grew)
    print(f"\nload average (1, 5, 15 min): {load_before} before, {load_after} after; {os.cpu_count()} CPUs")
    if args.quick:
        return
    machine = (f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}, "
               f"{cpu_name()}, {os.cpu_count()} CPUs")
    doc = (
        "# Compile time at scale\n\n"
        "Generated by `benchmarks/bench_compile.py` (synthetic 1F1B pipelines, no torch; "
        f"{machine}; GC {'off' if args.no_gc else 'on'}"
        + (f"; each row the fastest of {args.repeat} runs" if args.repeat > 1 else "")
        + f"). Load average (1, 5, 15 min) `{load_before}` before the run and `{load_after}` after it: the "
        "machine is shared, so wall seconds include waiting for a CPU. "
        + ("Seconds per stage and `total s` are the process's CPU seconds (`--clock cpu`), which the other jobs "
           "move less; `wall s` is the wall time of the same stages. "
           if args.clock == "cpu" else
           "Seconds per stage (wall); `cpu s` is the process CPU time of the timed stages. ")
        + "`verify` is also "
        "part of `compile` and is not added to the total, nor is `json` (the program's JSON, as `piper plan "
        f"--out` writes it: {rows[-1]['json_mb']:.0f} MB in the last row), nor `probe`: one lookup of each edge's two "
        "ends in the graph's node table, the least a pass over the edges does, timed to show what the machine "
        "adds per 4x of the graph apart from any algorithm (the graph, its id strings and its tables outgrow "
        "the CPU's caches). `peak MB` is the peak resident memory of the process "
        f"that ran the row (each row runs in a fresh one; {min(r['base_mb'] for r in rows):.0f} MB of it is the "
        "interpreter and imports). "
        "Data-parallel replicas share one plan, so the compiled graph is one replica's pipeline: nodes and edges "
        "grow with PP x microbatches x segments, not with the device count.\n\n" + text
        + "\n\nGrowth from one row to the next (one segment per stage):\n\n" + grew
        + "\n\n![compile time, log-log](compile-scaling.png)\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile-scaling.md").write_text(doc)
    plot(rows, args.out / "compile-scaling.png", "CPU seconds" if args.clock == "cpu" else "seconds")
    print(f"\nwrote {args.out / 'compile-scaling.md'} and {args.out / 'compile-scaling.png'}")


if __name__ == "__main__":
    main()
