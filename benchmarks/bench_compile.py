"""Compile time at scale: apply -> compile -> memory on synthetic pipelines up to 4096 devices.

Each configuration is PP pipeline ranks x DP data-parallel replicas, M microbatches and S
segments per pipeline stage, scheduled with 1F1B. Data-parallel replicas run the same plan on
other devices, so the compiler works on one replica's pipeline: the work grows with
PP x M x S (nodes and edges), not with the device count PP x DP. Stages timed:

- ``split``, ``place``, ``order``, ``validate``: the directive passes, as ``Strategy.apply``
  runs them (``place``: ``place_all`` then ``insert_communication``; the Orders through
  ``apply_orders``: one cycle search for all of them);
- ``compile``: ``compile_program`` (it validates its input and verifies its output);
- ``verify``: ``verify`` alone on the compiled program (already included in ``compile``);
- ``memory``: ``piper_memory.estimate_memory`` on the program.

No torch is imported. Prints a Markdown table; writes it to ``docs/compile-scaling.md`` and a
log-log plot to ``docs/compile-scaling.png``.

    .venv/bin/python benchmarks/bench_compile.py            # the full table (about a minute)
    .venv/bin/python benchmarks/bench_compile.py --quick    # the small configurations only
"""

from __future__ import annotations

import argparse
import gc
import platform
import time
from pathlib import Path

from piper_directives.communication import insert_communication
from piper_directives.order import Order, apply_orders
from piper_directives.place import Place, place_all, send_streams
from piper_directives.schedules import build_schedule
from piper_directives.split import Split
from piper_directives.synthetic import synthetic_graph
from piper_ir import validate
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
]
QUICK = CONFIGS[:3]
STAGES = ("split", "place", "order", "validate", "compile", "verify", "memory")


def run(pp: int, dp: int, m: int, s: int, schedule: str = "1f1b") -> dict:
    graph = synthetic_graph(pp, m, s, hidden=1024, batch=1)
    strategy = build_schedule(schedule, pp, m)
    directives = strategy.directives
    times: dict[str, float] = {}

    def timed(name: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        times[name] = time.perf_counter() - t0
        return out

    (split,) = [d for d in directives if isinstance(d, Split)]
    g = timed("split", split.apply, graph)
    places = [d for d in directives if isinstance(d, Place)]
    g = timed("place", lambda g: insert_communication(place_all(g, places), send_streams(g, places)), g)
    g = timed("order", apply_orders, g, [d for d in directives if isinstance(d, Order)])
    g = timed("validate", validate, g)
    program = timed("compile", compile_program, g)
    timed("verify", verify, program)
    timed("memory", estimate_memory, program)
    total = sum(v for k, v in times.items() if k != "verify")  # verify already runs inside compile
    return {
        "pp": pp, "dp": dp, "devices": pp * dp, "microbatches": m, "segments": s,
        "nodes": len(g.nodes), "edges": len(g.edges),
        "instructions": sum(len(p.instructions) for p in program.ranks),
        **times, "total": total,
    }


def table(rows: list[dict]) -> str:
    head = "| devices (PP x DP) | M | seg/stage | nodes | edges | " + " | ".join(STAGES) + " | total s |"
    lines = [head, "|" + "---|" * (6 + len(STAGES))]
    for r in rows:
        cells = [f"{r['devices']} ({r['pp']} x {r['dp']})", str(r["microbatches"]), str(r["segments"]),
                 f"{r['nodes']:,}", f"{r['edges']:,}", *(f"{r[k]:.2f}" for k in STAGES), f"**{r['total']:.2f}**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
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
    ax.axhline(10, color="red", lw=0.8, label="10 s target")
    ax.set_xlabel("graph size (nodes + edges)")
    ax.set_ylabel("seconds")
    ax.set_title("Piper compile time, 1F1B, synthetic pipeline", loc="left")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the three small configurations, no files written")
    parser.add_argument("--no-gc", action="store_true", help="disable Python's cyclic garbage collector while timing")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where to write compile-scaling.{md,png}")
    args = parser.parse_args()
    rows = []
    for cfg in QUICK if args.quick else CONFIGS:
        gc.collect()
        if args.no_gc:
            gc.disable()
        rows.append(run(*cfg))
        gc.enable()
        r = rows[-1]
        print(f"PP={r['pp']:>3} DP={r['dp']:>3} M={r['microbatches']:>4} S={r['segments']}: "
              f"{r['nodes']:>8,} nodes {r['edges']:>8,} edges  {r['total']:6.2f} s", flush=True)
    text = table(rows)
    print()
    print(text)
    if args.quick:
        return
    machine = f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}"
    doc = (
        "# Compile time at scale\n\n"
        "Generated by `benchmarks/bench_compile.py` (synthetic 1F1B pipelines, no torch; "
        f"{machine}; GC {'off' if args.no_gc else 'on'}). Seconds per stage; `verify` is also part of "
        "`compile` and is not added to the total. Data-parallel replicas share one plan, so the compiled "
        "graph is one replica's pipeline: nodes and edges grow with PP x microbatches x segments, not with "
        "the device count.\n\n" + text + "\n\n![compile time, log-log](compile-scaling.png)\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile-scaling.md").write_text(doc)
    plot(rows, args.out / "compile-scaling.png")
    print(f"\nwrote {args.out / 'compile-scaling.md'} and {args.out / 'compile-scaling.png'}")


if __name__ == "__main__":
    main()
