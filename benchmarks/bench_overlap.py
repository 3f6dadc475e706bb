"""Expert all-to-all hidden under compute: DualPipeV vs 1F1B vs interleaved 1F1B, PP=2 x EP=2.

One mixture-of-experts model (4 regions, each a projection plus a residual MoE layer with 4
experts, top-2, a shared expert) trained with each schedule on 4 Ray workers (pipeline of 2
ranks, each stage expert-parallel over 2), SGD. Every schedule runs twice on the same plan:
with one thread per stream (the runtime's default: the two chunks of an overlapped F&B slot
run side by side, transfers and collectives on their own threads) and sequentially ("one
stream"). Reported per run: the median over steps of the slowest rank's time inside its step
and the mean over ranks of the time spent inside the expert all-to-alls. "Hidden" is the
share of the sequential run's all-to-all time that threading removed from the step:
``(sequential step - threaded step) / sequential all-to-all time``.

    .venv/bin/python benchmarks/bench_overlap.py [--microbatches 8] [--batch 256] [--steps 10]
        [--png docs/overlap/dualpipev-ep.png]

``--curve 32,64,128,256`` instead measures the fraction hidden as a function of the
compute/communication ratio: DualPipeV with threads and on one stream at each ``d_model``
(expert width 2x), the two runs alternating over ``--repeats`` rounds. The ratio is the
one-stream step's time outside the all-to-alls over its time inside them; "hidden" as above.
``--simulate`` prints the simulator's DualPipeV gain over 1F1B at DeepSeek's ratios
(``simulated_gains``), without running anything.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.nn.functional as F

from piper_directives import build_schedule, expert_parallel
from piper_directives.synthetic import synthetic_graph
from piper_runtime import OptimizerSpec, ensure_ray
from piper_scheduler import CostModel, compile_program, measured_timeline, plot_gantt, simulate
from piper_train.models import MoEModel
from piper_train.trainer import Trainer

PP, EP, REGIONS = 2, 2, 4
SCHEDULES = ("dualpipev", "1f1b", "interleaved_1f1b")


def _data(batch: int, d_in: int, d_out: int):
    teacher = torch.randn(d_in, d_out, generator=torch.Generator().manual_seed(7))

    def batches(step: int) -> tuple[tuple[torch.Tensor], tuple[torch.Tensor]]:
        x = torch.randn(batch, d_in, generator=torch.Generator().manual_seed(100 + step))
        return (x,), (torch.sin(x @ teacher / math.sqrt(d_in)),)

    return batches


def run(schedule: str, threads: bool, args: argparse.Namespace, d_model: int | None = None) -> dict:
    torch.manual_seed(0)
    model = MoEModel(args.d_in, d_model or args.d_model, args.d_out, REGIONS, num_experts=4, k=2, shared=True)
    batches = _data(args.batch, args.d_in, args.d_out)
    inputs, targets = batches(0)

    def strategy(stages: int):
        return expert_parallel(build_schedule(schedule, PP, args.microbatches, stages=stages), EP)

    inside, a2a, timings = [], [], None
    with Trainer(
        model, inputs, targets, F.mse_loss, strategy, optimizer=OptimizerSpec("sgd", 0.01), threads=threads,
        reuse_workers=True,
    ) as trainer:
        for step in range(args.warmup + args.steps):
            profile = step == args.warmup + args.steps - 1
            result = trainer.runtime.step(*batches(step), profile=profile)
            if step >= args.warmup:
                inside.append(max(result.worker_seconds))
                a2a.append(statistics.mean(result.collective_seconds))
            if profile:
                timings, program = result.timings, trainer.program
    return {"step": statistics.median(inside), "a2a": statistics.median(a2a), "timings": timings, "program": program}


def curve(args: argparse.Namespace) -> None:
    """Fraction of the all-to-all hidden by DualPipeV's threads, against compute/comm."""
    widths = [int(w) for w in args.curve.split(",")]
    print(f"DualPipeV, MoE PP={PP} x EP={EP}, batch {args.batch}, {args.microbatches} microbatches; "
          f"median of {args.steps} steps after {args.warmup}, {args.repeats} alternating rounds")
    print("| d_model | one stream ms | threads ms | all-to-all ms (one stream) | compute/comm | hidden "
          "| min(1, compute/comm) | load |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for width in widths:
        steps: dict[bool, list[float]] = {True: [], False: []}
        a2a: list[float] = []
        for r in range(args.repeats):
            for threads in (True, False) if r % 2 == 0 else (False, True):
                out = run("dualpipev", threads, args, d_model=width)
                steps[threads].append(out["step"])
                if not threads:
                    a2a.append(out["a2a"])
        seq, thr, comm = statistics.median(steps[False]), statistics.median(steps[True]), statistics.median(a2a)
        ratio = (seq - comm) / comm if comm else float("inf")
        print(f"| {width} | {seq * 1e3:.1f} | {thr * 1e3:.1f} | {comm * 1e3:.1f} | {ratio:.2f} | "
              f"{(seq - thr) / comm:.0%} | {min(1.0, ratio):.0%} | {os.getloadavg()[0]:.1f} |", flush=True)


def simulated_gains(ratios: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0), pps: tuple[int, ...] = (4, 8)) -> None:
    """The simulator's DualPipeV step against 1F1B's on the same ranks and ``2 pp`` regions,
    each region costing F=1, B=2 (W=1) of compute plus ``r`` times that in expert all-to-all.
    1F1B pays both in turn; a DualPipeV F&B pair hides one chunk's all-to-all under the
    other's compute, ``F&B = (F + B) max(1, r)`` (DeepSeek's premise), published at the
    pair's end (``pairs="atomic"``, their table's model); its unpaired chunks pay in full.
    DeepSeek-V3 reports a compute/communication ratio of about 1:1 for its cross-node
    expert parallelism (r = 1)."""
    print("| ranks | microbatches | comm/compute r | 1F1B step | DualPipeV, pairs not overlapped | DualPipeV step "
          "| DualPipeV gain | of which overlap |")
    print("|---|---|---|---|---|---|---|---|")
    for pp in pps:
        m = 4 * pp
        graph = synthetic_graph(2 * pp, m)
        one = compile_program(build_schedule("1f1b", pp, m, stages=2 * pp).apply(graph))
        dual = compile_program(build_schedule("dualpipev", pp, m, stages=2 * pp).apply(graph))
        for r in ratios:
            f, b = 1.0 * (1 + r), 2.0 * (1 + r)
            base = CostModel(F=f, B=b, BI=b / 2, BW=b / 2, overrides={"loss": {"F": 0, "B": 0}})
            fb = max(b, 3.0 * max(1.0, r))
            paired = CostModel(F=f, B=b, BI=b / 2, BW=b / 2, FB=fb, pairs="atomic", overrides={"loss": {"F": 0, "B": 0}})
            t1, t2 = simulate(one, base).makespan, simulate(dual, paired).makespan
            flat = simulate(dual, base).makespan
            print(f"| {pp} | {m} | {r:g} | {t1:.1f} | {flat:.1f} | {t2:.1f} | {t1 / t2:.2f} | {flat / t2:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--d-in", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--d-out", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--png", type=Path, help="write the Gantt chart of a threaded DualPipeV step")
    parser.add_argument("--curve", help="d_model values (comma-separated): the hidden-fraction curve")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--simulate", action="store_true", help="only the simulator's DualPipeV gains")
    args = parser.parse_args()
    if args.simulate:
        simulated_gains()
        return
    ensure_ray(num_cpus=max(os.cpu_count() or 1, PP * EP))
    if args.curve:
        curve(args)
        return

    print(
        f"MoE d_model={args.d_model}, 4 experts top-2 + shared, {REGIONS} regions, batch {args.batch}, "
        f"{args.microbatches} microbatches; PP={PP} x EP={EP}; median of {args.steps} steps after {args.warmup}"
    )
    results: dict[tuple[str, bool], dict] = {}
    for schedule in SCHEDULES:
        for threads in (True, False):
            started = time.perf_counter()
            results[(schedule, threads)] = r = run(schedule, threads, args)
            mode = "threads" if threads else "one stream"
            print(
                f"  {schedule:17s} {mode:10s} step {r['step'] * 1e3:7.1f} ms, all-to-all {r['a2a'] * 1e3:6.1f} ms "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )

    print()
    print("| schedule | one stream ms | threads ms | speed-up | all-to-all ms (one stream) | hidden |")
    print("|---|---|---|---|---|---|")
    for schedule in SCHEDULES:
        seq, thr = results[(schedule, False)], results[(schedule, True)]
        hidden = (seq["step"] - thr["step"]) / seq["a2a"] if seq["a2a"] else float("nan")
        print(
            f"| {schedule} | {seq['step'] * 1e3:.1f} | {thr['step'] * 1e3:.1f} | {seq['step'] / thr['step']:.2f} | "
            f"{seq['a2a'] * 1e3:.1f} | {hidden:.0%} |"
        )
    base = results[("1f1b", True)]["step"]
    print()
    print("throughput relative to 1F1B (threads): " + ", ".join(
        f"{s} {base / results[(s, True)]['step']:.2f}" for s in SCHEDULES
    ))
    if args.png:
        r = results[("dualpipev", True)]
        spans = [(t.rank, t.instruction, t.start * 1e3, t.end * 1e3) for t in r["timings"]]
        args.png.parent.mkdir(parents=True, exist_ok=True)
        plot_gantt(
            measured_timeline(r["program"], spans),
            args.png,
            title=f"DualPipeV, PP={PP} x EP={EP}, one measured step (each rank's clock from its step start)",
            unit="ms",
        )
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
