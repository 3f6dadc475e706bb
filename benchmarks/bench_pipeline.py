"""Piper vs ``torch.distributed.pipelining``: the same model, data, ranks and schedule.

Both sides run their collectives on gloo over loopback (torch its point-to-point messages
too; Piper sends those through shared memory between ranks on one host unless
``PIPER_SHM_DISABLE=1``), one CPU thread per rank, AdamW, ``pp`` ranks and
``microbatches`` microbatches; interleaved 1F1B runs two regions per rank (rank r holds
regions r and r + pp on both sides). torch's side times each step between barriers on rank 0
(``torch_pipelining.py``, batches made before the barrier). Piper's side is what a training
loop gets from ``Trainer.submit`` with one step in flight ahead (as ``fit`` runs): the time
between consecutive steps' results arriving on the driver, batches made beforehand. Also
printed: the slowest rank's time inside its step ("in-worker") and the same Trainer stepping
one call at a time (``Trainer.step``: a driver round trip per step, "sync"), the same
Trainer sending ``--steps-per-call`` steps in one call per rank ("N per call":
``Trainer.submit_steps`` with one call in flight ahead, as ``piper train --steps-per-call N``
runs; the time between calls' results over their steps), the same Trainer under ``fit``
with its default ``steps_per_call="auto"`` ("fit": what ``piper train`` runs; single steps
while the first few are timed, then as many per call as take about half a second; the
steps after those first four, ``StepMetrics.step_seconds``), and the CPU time the ranks'
processes spent per step (all threads, summed over ranks), Piper's over
torch's: on an oversubscribed machine wall times follow the load, CPU time much less.

"set-up s": each side's median set-up, apart from its steps: torch's is a run's wall time
less its timed steps (spawning its rank processes, their imports, the model, the process
group, its warm-up step, exiting); Piper's is a ``Trainer``'s construction (capture,
compile, the ranks set up on pooled Ray workers, started once for the whole run) to the end
of its warm-up step. Neither is in any step figure.

"bound/torch" is the fastest any runtime could step the row's schedule on this machine with
torch's kernels, over torch's step: each compute instruction at the time it takes alone
(the same regions run by one rank on one core, each microbatch's forward then its backward,
medians over profiled steps of Piper's runtime with its fusion of weight-gradient
accumulation off: the kernels torch's side calls), messages free, simulated on the row's
program (``piper_scheduler.simulate``); with fewer cores than ranks, also at least the
step's whole compute spread over the cores. No runtime beats it but by computing faster
than alone or computing less: Piper's step can go below it where it adds weight gradients
inside the matrix product (``piper_runtime.rank.accumulation``: weights of 1 MiB or more, the
``stack`` model's). "piper/bound" is how far Piper's step is from it.

The two sides alternate (torch, Piper, Piper, torch, ...) for ``--repeats`` rounds and each
figure is the median over every timed step of its rounds, so load that drifts during the
run (this machine is shared) falls on both. The load average is printed with each row, and
"by round" gives the lowest and highest of the rounds' own Piper/torch ratios (each round's
pipelined Piper median over its torch median): the spread a single figure hides; "fit by
round" the same for ``fit``'s steps.

``--compile BACKEND`` runs both sides through ``torch.compile``: Piper's segments (``Trainer(
compile=...)``: each segment's forward and backward, the split weight pass of a stage's last
backward, large weight gradients added inside their product) and torch's stage modules
(``torch.compile(module)`` handed to ``PipelineStage``, in processes that keep freed memory
as Piper's compiled ranks do: ``torch_pipelining.py``). Each side's set-up then includes its
compiling (inductor's on-disk cache makes later rounds and runs cheaper), and "bound/torch" is
computed the same way from Piper's compiled segments run alone (torch's compiled stages are
other graphs, so it is no longer the bound of torch's kernels).

AdamW runs as each side's default unless told: Piper's "auto" is torch's fused kernel,
torch's own default on the CPU is its for-loop. ``--torch-optimizer-impl fused`` (or
``--optimizer-impl for-loop``) compares like for like, so that only the runtimes differ.

    .venv/bin/python benchmarks/bench_pipeline.py [--models stack,mlp,transformer,lm]
        [--schedules gpipe,1f1b,interleaved_1f1b] [--pp 2 4] [--microbatches 8] [--steps 6] [--repeats 2]
        [--steps-per-call 4] [--optimizer-impl auto] [--torch-optimizer-impl default] [--compile inductor]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from stepping import cpu_seconds
from torch_pipelining import CHUNKS, run_torch_pipeline

from piper_ir import NodeKind, Program
from piper_runtime import OptimizerSpec, ensure_ray
from piper_runtime.backends.cpu import shm_enabled
from piper_runtime.optim import IMPLEMENTATIONS, TORCH_KEYWORDS
from piper_scheduler import CostModel, simulate
from piper_train.loop import fit
from piper_train.models import build_model
from piper_train.trainer import Trainer

LR = 1e-3
FIT_MEASURED = 4  # fit's first steps, timed one call each before it sizes its calls


def run_piper(
    schedule: str, model_name: str, pp: int, microbatches: int, steps: int, warmup: int = 1, sync_steps: int = 0,
    cpu: list[float] | None = None, grouped: list[float] | None = None, steps_per_call: int = 4,
    implementation: str = "auto", fitted: list[float] | None = None, programs: list[Program] | None = None,
    setup: list[float] | None = None, compile: str | None = None,
) -> tuple[list[float], list[float], list[float]]:
    """Pipelined step times (between results), in-worker times, and sync step times; ``cpu``
    receives the workers' CPU seconds per pipelined step, summed over ranks; ``grouped``
    receives step times with ``steps_per_call`` steps per call (``Trainer.submit_steps``,
    one call in flight ahead, as ``fit(steps_per_call=...)`` runs): the time between
    consecutive calls' results over their steps; ``fitted`` receives ``fit``'s step times
    (its default call sizes) after its first ``FIT_MEASURED`` steps; ``programs`` receives the
    compiled program; ``setup`` the seconds from the ``Trainer``'s construction to the end of
    its first step (capture, compile, ranks set up on pooled workers, the first step);
    ``compile``: the ``torch.compile`` backend of the segments (``None``: eager)."""
    spec = build_model(model_name, stages=pp * CHUNKS[schedule])
    started = time.perf_counter()
    calls = max(3, steps // steps_per_call + 1) if grouped is not None else 0
    fit_steps = FIT_MEASURED + 2 * steps if fitted is not None else 0
    batches = [spec.batches(step) for step in range(warmup + steps + sync_steps + calls * steps_per_call + fit_steps)]
    with Trainer.with_schedule(
        spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn,
        schedule=schedule, pp=pp, microbatches=microbatches, optimizer=OptimizerSpec("adamw", LR, implementation=implementation),
        reuse_workers=True, compile=compile,
    ) as trainer:
        if programs is not None:
            programs.append(trainer.program)
        for batch in batches[:warmup]:
            trainer.step(*batch)
        if setup is not None:
            setup.append(time.perf_counter() - started)
        pids = ray.get([w.ping.remote() for w in trainer.runtime._workers], timeout=60)
        cpu_start = sum(cpu_seconds(p) for p in pids)
        times, inside = [], []
        last = time.perf_counter()
        pending = None
        for batch in batches[warmup : warmup + steps]:
            ahead = trainer.submit(*batch)
            if pending is not None:
                inside.append(max(pending.result().worker_seconds))
                now = time.perf_counter()
                times.append(now - last)
                last = now
            pending = ahead
        if pending is not None:
            inside.append(max(pending.result().worker_seconds))
            times.append(time.perf_counter() - last)
        if cpu is not None:
            cpu.append((sum(cpu_seconds(p) for p in pids) - cpu_start) / steps)
        sync = []
        for batch in batches[warmup + steps : warmup + steps + sync_steps]:
            t0 = time.perf_counter()
            trainer.step(*batch)
            sync.append(time.perf_counter() - t0)
        rest = batches[warmup + steps + sync_steps : len(batches) - fit_steps]
        last, previous = None, None
        for c in range(calls):
            ahead_call = trainer.submit_steps(rest[c * steps_per_call : (c + 1) * steps_per_call])
            if previous is not None:
                previous[-1].result()
                now = time.perf_counter()
                if last is not None:  # the first call's time includes filling the pipeline
                    grouped.extend([(now - last) / steps_per_call] * steps_per_call)
                last = now
            previous = ahead_call
        if previous is not None:
            previous[-1].result()
            grouped.extend([(time.perf_counter() - last) / steps_per_call] * steps_per_call)
        if fitted is not None:
            run = fit(trainer, iter(batches[len(batches) - fit_steps :]), steps=trainer.state.step + fit_steps)
            fitted.extend(m.step_seconds for m in run.steps[FIT_MEASURED:])
    return times, inside, sync


COMPUTE = (NodeKind.COMPUTE, NodeKind.OPTIMIZER)


def compute_bound(
    schedule: str, model_name: str, pp: int, microbatches: int, program: Program, steps: int = 4,
    implementation: str = "auto", compile: str | None = None,
) -> float:
    """The shortest step any runtime could take for ``program`` on this machine (module
    doc): costs alone from one rank running the same regions (each microbatch's forward,
    then its backward: the warmest order), simulated with free messages; at least the
    step's compute over the host's cores. ``compile``: the regions run compiled, as Piper's
    ``compile=`` runs them."""
    spec = build_model(model_name, stages=pp * CHUNKS[schedule])
    durations: dict[tuple[str, str], list[float]] = {}
    with Trainer.with_schedule(
        spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn,
        schedule="1f1b", pp=1, microbatches=microbatches,
        optimizer=OptimizerSpec("adamw", LR, implementation=implementation), reuse_workers=True,
        grad_fusion_min_bytes=None,  # torch's kernels: autograd adds each weight gradient
        compile=compile,
    ) as alone:
        by_id = {ins.id: ins for plan in alone.program.ranks for ins in plan.instructions}
        for step in range(steps + 1):
            result = alone.step(*spec.batches(step), profile=True)
            if step == 0:
                continue  # warm-up
            for t in result.timings:
                ins = by_id[t.instruction]
                if ins.kind in COMPUTE:
                    durations.setdefault((ins.segment, ins.phase.value), []).append(t.end - t.start)
    overrides: dict[str, dict[str, float]] = {}
    for (segment, phase), ds in durations.items():
        overrides.setdefault(segment, {})[phase] = statistics.median(ds)
    costs = CostModel(F=0.0, B=0.0, BI=0.0, BW=0.0, OPT=0.0, overrides=overrides)
    work = sum(costs.compute_cost(ins.segment, ins.phase)
               for plan in program.ranks for ins in plan.instructions if ins.kind in COMPUTE)
    return max(simulate(program, costs).makespan, work / min(pp, os.cpu_count() or 1))


TORCH_KWARGS = {"default": {}, **TORCH_KEYWORDS}  # torch's side: its own default, or one of Piper's choices


def compare(
    model: str, schedule: str, pp: int, microbatches: int, steps: int, repeats: int, steps_per_call: int,
    implementation: str = "auto", torch_implementation: str = "default", compile: str | None = None,
) -> dict[str, float]:
    torch_t: list[float] = []
    grouped: list[float] = []
    fitted: list[float] = []
    piper_t: list[float] = []
    inside: list[float] = []
    sync: list[float] = []
    torch_cpu: list[float] = []
    piper_cpu: list[float] = []
    torch_setup: list[float] = []  # a run's wall time less its timed steps: processes, imports, model, warm-up
    piper_setup: list[float] = []
    programs: list[Program] = []
    loads = [os.getloadavg()[0]]

    def torch_side() -> None:
        started = time.perf_counter()
        timed = run_torch_pipeline(schedule, model, pp, microbatches, steps, warmup=1, lr=LR, optimizer="adamw",
                                   optimizer_kwargs=TORCH_KWARGS[torch_implementation], cpu=torch_cpu, compile=compile)
        torch_setup.append(time.perf_counter() - started - sum(timed))
        torch_t.extend(timed)

    def piper_side() -> None:
        t, i, s = run_piper(schedule, model, pp, microbatches, steps, sync_steps=max(2, steps // 2), cpu=piper_cpu,
                            grouped=grouped, steps_per_call=steps_per_call, implementation=implementation,
                            fitted=fitted, programs=programs, setup=piper_setup, compile=compile)
        piper_t.extend(t)
        inside.extend(i)
        sync.extend(s)

    rounds: list[float] = []  # each round's Piper median over its torch median: the run's spread
    fit_rounds: list[float] = []  # ... and fit's
    for r in range(repeats):
        before = len(torch_t), len(piper_t), len(fitted)
        for side in (torch_side, piper_side) if r % 2 == 0 else (piper_side, torch_side):
            side()
            loads.append(os.getloadavg()[0])
        torch_round = statistics.median(torch_t[before[0]:])
        rounds.append(statistics.median(piper_t[before[1]:]) / torch_round)
        fit_rounds.append(statistics.median(fitted[before[2]:]) / torch_round)
    t, p = statistics.median(torch_t), statistics.median(piper_t)
    bound = compute_bound(schedule, model, pp, microbatches, programs[0], implementation=implementation, compile=compile)
    return {"bound": bound, "torch": t, "piper": p, "inside": statistics.median(inside), "sync": statistics.median(sync),
            "grouped": statistics.median(grouped), "fit": statistics.median(fitted), "low": min(rounds), "high": max(rounds),
            "fit_low": min(fit_rounds), "fit_high": max(fit_rounds),
            "load": statistics.fmean(loads), "cpu": statistics.median(piper_cpu) / statistics.median(torch_cpu),
            "torch_setup": statistics.median(torch_setup), "piper_setup": statistics.median(piper_setup)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="stack,mlp,transformer,lm")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps-per-call", type=int, default=4)
    parser.add_argument("--optimizer-impl", default="auto", choices=IMPLEMENTATIONS,
                        help="Piper's AdamW implementation (default: auto, Piper's own default: fused)")
    parser.add_argument("--torch-optimizer-impl", default="default", choices=sorted(TORCH_KWARGS),
                        help="torch's AdamW implementation (default: torch's own default, the for-loop on the CPU)")
    parser.add_argument("--compile", metavar="BACKEND", choices=("inductor", "aot_eager"),
                        help="both sides through torch.compile with this backend: Piper's segments, torch's stage modules")
    args = parser.parse_args()
    # One embedded cluster for every row: with as many logical CPUs as the widest row's ranks
    # (reused workers reserve no bundle, but the cluster must be large enough for them).
    ensure_ray(num_cpus=max(os.cpu_count() or 1, 2 * max(args.pp)))
    transport = "shared memory" if shm_enabled() else "gloo"
    print(f"Piper vs torch.distributed.pipelining — CPU, Piper's messages through {transport}, torch's through gloo,"
          f" AdamW (Piper: {args.optimizer_impl}, torch: {args.torch_optimizer_impl}), {args.microbatches} microbatches, "
          f"{args.steps} timed steps per round after 1 warm-up, {args.repeats} alternating rounds, medians"
          + (f"; both sides compiled (torch.compile, {args.compile})" if args.compile else "; eager"))
    k = args.steps_per_call
    header = (f"{'model':<12} {'schedule':<17} {'pp':>2} {'torch ms':>9} {'piper ms':>9} {'piper/torch':>12}"
              f" {'by round':>10}"
              f" {f'{k} per call/torch':>17} {'fit/torch':>10} {'fit by round':>13} {'in-worker/torch':>16} {'sync/torch':>11} {'CPU/torch':>10}"
              f" {'bound/torch':>12} {'piper/bound':>12} {'set-up s torch':>15} {'piper':>6} {'load':>5}")
    print(header + "\n" + "-" * len(header), flush=True)
    for model in args.models.split(","):
        for pp in args.pp:
            for schedule in args.schedules.split(","):
                r = compare(model, schedule, pp, args.microbatches, args.steps, args.repeats, k,
                            args.optimizer_impl, args.torch_optimizer_impl, args.compile)
                spread = f"{r['low']:.2f}-{r['high']:.2f}"
                fit_spread = f"{r['fit_low']:.2f}-{r['fit_high']:.2f}"
                print(f"{model:<12} {schedule:<17} {pp:>2} {r['torch'] * 1e3:>9.1f} {r['piper'] * 1e3:>9.1f}"
                      f" {r['piper'] / r['torch']:>12.2f} {spread:>10}"
                      f" {r['grouped'] / r['torch']:>17.2f} {r['fit'] / r['torch']:>10.2f} {fit_spread:>13}"
                      f" {r['inside'] / r['torch']:>16.2f}"
                      f" {r['sync'] / r['torch']:>11.2f} {r['cpu']:>10.2f}"
                      f" {r['bound'] / r['torch']:>12.2f} {r['piper'] / r['bound']:>12.2f}"
                      f" {r['torch_setup']:>15.2f} {r['piper_setup']:>6.2f} {r['load']:>5.1f}", flush=True)


if __name__ == "__main__":
    main()
