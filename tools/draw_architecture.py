"""Draw docs/architecture.png, the flow of docs/architecture.md (``python tools/draw_architecture.py``).

Kept as code so the picture changes with the modules it names."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

STAGES = [
    ("capture", "nn.Module + annotate", "piper-directives",
     ["capturing.py", "training_graph.py", "randomness.py", "precision.py"], "ir.Graph: one device"),
    ("apply", "Strategy (directives)", "piper-directives",
     ["split.py  place.py", "replicate.py  shard.py", "order.py  schedules.py", "parallelize.py"],
     "ir.Graph: global DAG"),
    ("plan memory", "ZeRO level per bucket", "piper-memory",
     ["plan.py", "estimate.py", "grad_norm.py"], "ir.Graph + buckets"),
    ("compile", "the global DAG", "piper-scheduler",
     ["compile.py", "communicators.py", "verify.py", "references.py"], "ir.Program: verified"),
]
BLUE, GREEN = "#3a6ea5", "#4a8a3a"


def box(ax, x, y, w, h, colour, face) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.15", fc=face, ec=colour, lw=2))


def arrow(ax, start, end) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=18, lw=1.8, color="#333"))


def main() -> None:
    fig, ax = plt.subplots(figsize=(13, 6.4))
    ax.set_xlim(0, 13)
    ax.set_ylim(0, 6.4)
    ax.axis("off")
    ax.text(6.5, 6.1, "Each arrow is a pure function from one IR value (piper-ir, no torch) to the next",
            ha="center", fontsize=13, weight="bold")
    w, h, gap, y = 2.75, 3.0, 0.45, 2.7
    for i, (name, given, package, modules, out) in enumerate(STAGES):
        x = 0.2 + i * (w + gap)
        box(ax, x, y, w, h, BLUE, "#eef4fb")
        ax.text(x + w / 2, y + h - 0.35, name, ha="center", fontsize=13, weight="bold")
        ax.text(x + w / 2, y + h - 0.65, f"in: {given}", ha="center", fontsize=9, color="#555")
        ax.text(x + w / 2, y + h - 1.0, package, ha="center", fontsize=11, color=BLUE, weight="bold")
        for j, m in enumerate(modules):
            ax.text(x + 0.2, y + h - 1.35 - j * 0.3, m, fontsize=9.5, family="monospace")
        ax.text(x + w / 2, y + 0.15, f"out: {out}", ha="center", fontsize=9, color="#555")
        if i:
            arrow(ax, (x - gap, y + h / 2), (x, y + h / 2))
    compile_x = 0.2 + 3 * (w + gap)
    ends = [
        ("run", "piper-runtime", "driver/: Runtime over Ray | local | torchrun\nrank/: worker, executor  backends/: cpu, local, cuda",
         "losses, gradients, parameters (any runtime)", 3.4, 5.2),
        ("simulate", "piper-scheduler", "simulate.py  costs.py  timeline.py", "timeline, step time, idle per rank",
         9.0, 3.8),
    ]
    for name, package, modules, out, x, bw in ends:
        box(ax, x, 0.55, bw, 1.6, GREEN, "#f3f8ee")
        ax.text(x + bw / 2, 1.85, f"{name}   ({package})", ha="center", fontsize=12, weight="bold", color="#222")
        ax.text(x + bw / 2, 1.05, modules, ha="center", fontsize=9.5, family="monospace")
        ax.text(x + bw / 2, 0.68, out, ha="center", fontsize=9, color="#555")
        arrow(ax, (compile_x + w / 2, y), (x + bw / 2, 2.15))
    ax.text(0.2, 0.12, "front door: piper-train (Trainer, fit, the piper CLI) composes the packages; "
            "they meet only through piper_ir values", fontsize=9.5, color="#555")
    out = Path(__file__).resolve().parents[1] / "docs" / "architecture.png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    main()
