"""Does the simulator predict the CPU runtime? Costs from a 1F1B run's own timings.

1. Run ``Trainer.with_schedule`` (1F1B, Ray + gloo on 127.0.0.1) for warm-up + timed steps
   with ``profile=True``: every worker returns when each instruction started and ended
   (``StepResult.timings``) and its time inside the step (``StepResult.worker_seconds``); the
   driver times each ``step`` call.
2. Costs from the timed steps of that same run (means over its instructions):
   - compute: the mean duration of each (segment, phase) instruction -> ``CostModel.overrides``;
   - ``overhead``: the gap between one instruction's end and the next one's start on a rank
     (freeing values, memory sampling), charged to every compute instruction;
   - ``latency``: a SEND's mean duration (posting the message to gloo); ``comm_overhead``:
     the gap plus the shortest RECV (a receive whose message had already arrived: completing
     and copying it; the rest of a RECV's time is waiting, which the
     simulator must reproduce, not be told);
   - ``startup``: the time before a rank's first instruction (splitting the batch into
     microbatches); the tail after the last one (waiting for sends) is added to the makespan.
3. ``simulate`` the compiled program; compare with the in-worker step time
   (``max(worker_seconds)``) and with the driver-measured step time.

    RAY_USAGE_STATS_ENABLED=0 GLOO_SOCKET_IFNAME=lo .venv/bin/python benchmarks/bench_simulate_vs_runtime.py \
        [--model lm] [--pp 2] [--microbatches 2 8 16] [--steps 10]

Timings on a shared machine are noisy; the script prints its figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

from piper_ir import NodeKind
from piper_runtime import OptimizerSpec
from piper_scheduler import CostModel, simulate
from piper_train import Trainer
from piper_train.models import build_model


def run(spec, pp: int, microbatches: int, steps: int, warmup: int):
    """(program, driver seconds per step, StepResults) for the timed steps."""
    with Trainer.with_schedule(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn,
                               schedule="1f1b", pp=pp, microbatches=microbatches,
                               optimizer=OptimizerSpec("sgd", 0.01)) as trainer:
        driver, results = [], []
        for step in range(warmup + steps):
            inputs, targets = spec.batches(step)
            t0 = time.perf_counter()
            result = trainer.step(inputs, targets, profile=True)
            if step >= warmup:
                driver.append(time.perf_counter() - t0)
                results.append(result)
        return trainer.program, driver, results


def costs_from_run(program, results) -> tuple[CostModel, float, dict[str, float]]:
    """A CostModel from the run's per-instruction timings, the tail to add, and a summary."""
    by_id = {(plan.rank, ins.id): ins for plan in program.ranks for ins in plan.instructions}
    compute: dict[tuple[str, str], list[float]] = defaultdict(list)
    sends, recvs, gaps, starts, tails = [], [], [], [], []
    for result in results:
        per_rank: dict[int, list] = defaultdict(list)
        for t in result.timings:
            per_rank[t.rank].append(t)
        for rank, timings in per_rank.items():
            timings.sort(key=lambda t: t.start)
            starts.append(timings[0].start)
            tails.append(result.worker_seconds[rank] - timings[-1].end)
            gaps.extend(b.start - a.end for a, b in zip(timings, timings[1:], strict=False))
            for t in timings:
                ins = by_id[(rank, t.instruction)]
                if ins.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER):
                    compute[(ins.segment, ins.phase.value)].append(t.end - t.start)
                elif ins.kind is NodeKind.SEND:
                    sends.append(t.end - t.start)
                elif ins.kind is NodeKind.RECV:
                    recvs.append(t.end - t.start)
    # Means, not medians: on an oversubscribed machine a few instructions are descheduled for
    # milliseconds, and a step's time is the sum of what every instruction really took.
    gap = statistics.fmean(gaps) if gaps else 0.0
    overrides: dict[str, dict[str, float]] = defaultdict(dict)
    for (seg, phase), ds in compute.items():
        overrides[seg][phase] = statistics.fmean(ds)
    latency = statistics.fmean(sends) if sends else 0.0
    recv_done = min(recvs, default=0.0)
    costs = CostModel(F=0, B=0, BI=0, BW=0, OPT=0, overrides=overrides, latency=latency,
                      overhead=gap, comm_overhead=gap + recv_done, startup=statistics.median(starts))
    summary = {"gap": gap, "send": latency, "recv_done": recv_done, "recv_median": statistics.median(recvs),
               "startup": costs.startup, "tail": statistics.median(tails),
               "compute_per_step": sum(sum(ds) / len(results) for ds in compute.values()),
               "compute_median_per_step": sum(statistics.median(ds) * len(ds) / len(results) for ds in compute.values()),
               "gaps_per_step": sum(gaps) / len(results)}
    return costs, summary["tail"], summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lm", choices=["mlp", "transformer", "lm"])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    spec = build_model(args.model, stages=args.pp, seed=0)
    rows = []
    for m in args.microbatches:
        program, driver, results = run(spec, args.pp, m, args.steps, args.warmup)
        costs, tail, s = costs_from_run(program, results)
        simulated = simulate(program, costs).makespan + tail
        bare = simulate(program, CostModel(F=0, B=0, BI=0, BW=0, OPT=0, overrides=costs.overrides)).makespan
        worker = statistics.median(max(r.worker_seconds) for r in results)
        step = statistics.median(driver)
        rows.append((m, s, bare, simulated, worker, step))
        print(f"M={m}: compute {s['compute_per_step'] * 1e3:.1f} ms/step over all ranks (at the medians "
              f"{s['compute_median_per_step'] * 1e3:.1f}), gaps {s['gaps_per_step'] * 1e3:.1f}; gap {s['gap'] * 1e3:.3f} ms, "
              f"send {s['send'] * 1e3:.3f} ms, recv min {s['recv_done'] * 1e3:.3f} / median "
              f"{s['recv_median'] * 1e3:.3f} ms, startup {s['startup'] * 1e3:.2f} ms, tail {s['tail'] * 1e3:.2f} ms",
              flush=True)
    print(f"\nmodel {args.model}, 1F1B, pp={args.pp}, {args.steps} timed steps after {args.warmup} warm-up (medians)")
    print("| microbatches | simulated, compute only (ms) | simulated, all costs (ms) | in-worker step, max over "
          "ranks (ms) | sim / worker | driver step (ms) | sim / driver |")
    print("|---|---|---|---|---|---|---|")
    for m, _s, bare, sim, worker, step in rows:
        print(f"| {m} | {bare * 1e3:.1f} | {sim * 1e3:.1f} | {worker * 1e3:.1f} | {sim / worker:.2f} | "
              f"{step * 1e3:.1f} | {sim / step:.2f} |")


if __name__ == "__main__":
    main()
