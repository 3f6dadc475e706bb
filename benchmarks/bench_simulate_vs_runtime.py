"""Does the simulator predict the CPU runtime? Costs from each run's own timings.

For each model and schedule (1F1B, interleaved 1F1B, ZB1P, DualPipeV by default):

1. Run ``Trainer.with_schedule`` (Ray; gloo on 127.0.0.1 and shared-memory channels) for warm-up + timed steps
   with ``profile=True``: every worker returns when each instruction started and ended
   (``StepResult.timings``) and its time inside the step (``StepResult.worker_seconds``); the
   driver times the steps as ``fit`` runs them (one submitted ahead: the time between
   results).
2. Costs from the timed steps of that same run (means over its instructions):
   - compute: the mean duration of each (segment, phase) instruction that ran alone ->
     ``CostModel.overrides``; DualPipeV's overlapped pairs calibrate ``FB`` (the mean of a
     pair's wall time over its members' costs alone);
   - ``overhead``: the gap between one instruction's end and the next one's start on a rank
     (freeing values, posting receives, waking a lane), charged to every compute instruction;
   - ``latency``: a message's one-way time (``message_latency``: from a SEND's start to the
     end of the RECV that waited for it, both ways between two ranks so that their clocks'
     offset cancels) less the gap and the quickest receive, and at least a SEND's mean
     posting time; ``comm_overhead``: the gap plus the shortest RECV (a receive whose message had already arrived: completing
     and copying it; the rest of a RECV's time is waiting, which the
     simulator must reproduce, not be told);
   - ``startup``: the time before a rank's first instruction (splitting the batch into
     microbatches); the tail after the last one (waiting for sends) is added to the makespan.
3. ``simulate`` the compiled program; compare with the in-worker step time
   (``max(worker_seconds)``) and with the driver-measured step time.

    RAY_USAGE_STATS_ENABLED=0 GLOO_SOCKET_IFNAME=lo .venv/bin/python benchmarks/bench_simulate_vs_runtime.py \
        [--models lm,transformer] [--schedules 1f1b,interleaved_1f1b,zb1p,dualpipev] [--pp 2]
        [--microbatches 8] [--steps 8]

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


def run(spec, pp: int, microbatches: int, steps: int, warmup: int, schedule: str = "1f1b"):
    """(program, driver seconds per step, StepResults) for the timed steps. The driver's
    figure is what ``fit`` sees: the time between consecutive results with one step in
    flight ahead (``Trainer.submit``), batches made beforehand."""
    with Trainer.with_schedule(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn,
                               schedule=schedule, pp=pp, microbatches=microbatches,
                               optimizer=OptimizerSpec("sgd", 0.01), reuse_workers=True) as trainer:
        batches = [spec.batches(step) for step in range(warmup + steps)]
        for inputs, targets in batches[:warmup]:
            trainer.step(inputs, targets, profile=True)
        driver, results = [], []
        pending, last = None, time.perf_counter()
        for inputs, targets in [*batches[warmup:], (None, None)]:
            ahead = None if inputs is None else trainer.submit(inputs, targets, profile=True)
            if pending is not None:
                results.append(pending.result())
                now = time.perf_counter()
                driver.append(now - last)
                last = now
            pending = ahead
        return trainer.program, driver, results


def message_latency(program, results, recv_done: float) -> float | None:
    """A message's one-way time, from its SEND's start on one rank to the end of the RECV
    that waited for it on the other, from the run's own timings. Each rank's timings count
    from its own step start, so one direction alone mixes the latency with the offset
    between the two ranks' clocks; a message each way between the same two ranks in the
    same step cancels it (the median of each direction, averaged). Only receives that
    waited (longer than the quickest receive by 0.1 ms) say when their message arrived.
    ``None`` if no pair of ranks has such receives both ways."""
    by_id = {(plan.rank, ins.id): ins for plan in program.ranks for ins in plan.instructions}
    estimates = []
    for result in results:
        sent: dict[tuple[int, int, str, int], float] = {}  # (from, to, value, microbatch) -> start
        arrived: dict[tuple[int, int, str, int], float] = {}  # ... -> end of a RECV that waited
        for t in result.timings:
            ins = by_id[(t.rank, t.instruction)]
            if ins.kind is NodeKind.SEND:
                sent[(t.rank, ins.peer, ins.value, ins.microbatch)] = t.start
            elif ins.kind is NodeKind.RECV and t.end - t.start > recv_done + 1e-4:
                arrived[(ins.peer, t.rank, ins.value, ins.microbatch)] = t.end
        ways: dict[tuple[int, int], list[float]] = defaultdict(list)
        for key, end in arrived.items():
            if key in sent:
                ways[key[:2]].append(end - sent[key])
        for (a, b), there in ways.items():
            back = ways.get((b, a))
            if a < b and back:
                estimates.append((statistics.median(there) + statistics.median(back)) / 2)
    return statistics.median(estimates) if estimates else None


def costs_from_run(program, results) -> tuple[CostModel, float, dict[str, float]]:
    """A CostModel from the run's per-instruction timings, the tail to add, and a summary.

    Compute costs are the means of the instructions that ran alone; the instructions of an
    overlapped slot (DualPipeV's F&B pairs, run side by side on two threads) calibrate the
    pair model instead: ``FB / (F + B)`` is the mean over the run's pairs of the pair's wall
    time over what its members cost alone. Gaps are the time a rank runs no instruction
    between two (measured against the latest end so far, since lanes overlap)."""
    by_id = {(plan.rank, ins.id): ins for plan in program.ranks for ins in plan.instructions}
    compute: dict[tuple[str, str], list[float]] = defaultdict(list)
    sends, recvs, gaps, starts, tails = [], [], [], [], []
    slots: dict[tuple[int, int, int], list] = defaultdict(list)  # (step, rank, overlap) -> timings
    for index, result in enumerate(results):
        per_rank: dict[int, list] = defaultdict(list)
        for t in result.timings:
            per_rank[t.rank].append(t)
        for rank, timings in per_rank.items():
            timings.sort(key=lambda t: t.start)
            starts.append(timings[0].start)
            tails.append(result.worker_seconds[rank] - max(t.end for t in timings))
            reach = timings[0].start
            for t in timings:
                gaps.append(max(0.0, t.start - reach))
                reach = max(reach, t.end)
            for t in timings:
                ins = by_id[(rank, t.instruction)]
                if ins.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER):
                    if ins.overlap is not None:
                        slots[(index, rank, ins.overlap)].append((ins, t))
                    else:
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
    paired: dict[tuple[str, str], list[float]] = defaultdict(list)
    for members in slots.values():
        for ins, t in members:
            paired[(ins.segment, ins.phase.value)].append(t.end - t.start)
    for (seg, phase), ds in paired.items():  # a phase that only ever ran paired: its paired mean
        overrides[seg].setdefault(phase, statistics.fmean(ds))
    ratios = []
    for members in slots.values():
        alone = sum(overrides[ins.segment][ins.phase.value] for ins, _ in members)
        wall = max(t.end for _, t in members) - min(t.start for _, t in members)
        if alone > 0:
            ratios.append(min(1.0, max(0.5, wall / alone)))
    factor = statistics.fmean(ratios) if ratios else 1.0
    recv_done = min(recvs, default=0.0)
    posting = statistics.fmean(sends) if sends else 0.0
    one_way = message_latency(program, results, recv_done)
    latency = max(posting, one_way - gap - recv_done) if one_way is not None else posting
    costs = CostModel(F=1.0, B=1.0, BI=0.5, BW=0.5, OPT=0, overrides=overrides, latency=latency,
                      overhead=gap, comm_overhead=gap + recv_done, startup=statistics.median(starts),
                      FB=2.0 * factor if ratios else None)
    summary = {"gap": gap, "send": posting, "latency": latency, "recv_done": recv_done,
               "recv_median": statistics.median(recvs),
               "startup": costs.startup, "tail": statistics.median(tails), "pair_factor": factor,
               "compute_per_step": sum(sum(ds) / len(results) for ds in compute.values()),
               "compute_median_per_step": sum(statistics.median(ds) * len(ds) / len(results) for ds in compute.values()),
               "gaps_per_step": sum(gaps) / len(results)}
    return costs, summary["tail"], summary


def compare(model: str, schedule: str, pp: int, m: int, steps: int, warmup: int) -> dict[str, float]:
    """Run, take the costs from the run, simulate; the figures of one row."""
    spec = build_model(model, stages=pp * REGIONS_PER_RANK.get(schedule, 1), seed=0)
    program, driver, results = run(spec, pp, m, steps, warmup, schedule)
    costs, tail, s = costs_from_run(program, results)
    simulated = simulate(program, costs).makespan + tail
    worker = statistics.median(max(r.worker_seconds) for r in results)
    return {"sim": simulated, "worker": worker, "driver": statistics.median(driver), **s}


REGIONS_PER_RANK = {"interleaved_1f1b": 2, "dualpipev": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lm,transformer")
    parser.add_argument("--schedules", default="1f1b,interleaved_1f1b,zb1p,dualpipev")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(f"Simulated vs measured step, pp={args.pp}, {args.steps} timed steps after {args.warmup} warm-up "
          f"(medians), costs from each run's own timings; load average {os.getloadavg()[0]:.1f}")
    print("| model | schedule | microbatches | simulated (ms) | in-worker step, max over ranks (ms) | sim / worker "
          "| driver step (ms) | sim / driver | pair factor | send posting / one-way latency (us) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for model in args.models.split(","):
        for schedule in args.schedules.split(","):
            for m in args.microbatches:
                r = compare(model, schedule, args.pp, m, args.steps, args.warmup)
                factor = f"{r['pair_factor']:.2f}" if schedule == "dualpipev" else "-"
                print(f"| {model} | {schedule} | {m} | {r['sim'] * 1e3:.1f} | {r['worker'] * 1e3:.1f} | "
                      f"{r['sim'] / r['worker']:.2f} | {r['driver'] * 1e3:.1f} | {r['sim'] / r['driver']:.2f} | "
                      f"{factor} | {r['send'] * 1e6:.0f} / {r['latency'] * 1e6:.0f} | {os.getloadavg()[0]:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
