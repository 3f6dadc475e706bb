"""Does ``piper tune`` pick well? Every candidate that fits, measured on the CPU runtime.

For each model (default: the tiny transformer and the mixture-of-experts model) on
``--devices`` devices:

1. ``piper_train.tune`` profiles the model (cached under ``--cache-dir``) and ranks the
   space given by ``--microbatch-range``, ``--zero-levels`` and ``--schedules``;
2. every candidate that fits is run on the runtime (``measure_step``: warm-up steps, then
   the driver's median step time over ``--steps``), ``--rounds`` times in alternating order,
   keeping each candidate's fastest median (a shared machine slows a run down, never speeds
   it up);
3. it prints the tuned pick's measured step against the best measured one, and the
   Spearman rank correlation of predicted and measured step times. ``--reuse-measurements``
   takes the measured times from an earlier ``--out`` file (they do not depend on the
   predictor) and measures only what it lacks.

Then the memory-budget case (``--budget-model``, the pipeline held at ``--budget-pp``
stages: a budget just under the smallest ZeRO-0 estimate; the pick is run with that budget
and its measured peak compared), and the search time over the full space for
``--search-devices`` devices (the profile's missing variants filled from the measured ones:
the search's time does not depend on the values).

    GLOO_SOCKET_IFNAME=lo .venv/bin/python benchmarks/bench_tune.py [--models transformer moe] \\
        [--devices 4] [--microbatch-range 2,4] [--zero-levels 0,2] [--steps 5] [--rounds 2] [--out tune.json]

Prints figures and a markdown table; asserts nothing (timings on a shared machine are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import attrs

from piper_directives import SCHEDULES, capture
from piper_runtime import ensure_ray, shutdown
from piper_train.cli.tuning import _microbatches
from piper_train.models import build_model
from piper_train.tuning.api import _Sharder, measure_step, tune
from piper_train.tuning.costs import Profile
from piper_train.tuning.search import search
from piper_train.tuning.space import enumerate_space


def ranks(values: list[float]) -> list[float]:
    """Average ranks (ties share the mean of their positions), 1-based."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the average ranks."""
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def measure_all(model: str, args: argparse.Namespace) -> dict[str, object]:
    started = time.perf_counter()
    report = tune(model, args.devices, stages=args.stages, microbatches=_microbatches(args.microbatch_range),
                  schedules=args.schedules, zeros=args.zero_levels, cache_dir=args.cache_dir, log=print)
    fitting = report.result.fitting
    print(f"{model}: {report.space} candidates, {len(fitting)} fit; search {report.result.seconds:.1f} s, "
          f"profile {report.profile_seconds:.1f} s", flush=True)
    spec = build_model(model, stages=report.regions)
    best: dict[int, float] = {}
    if args.reuse_measurements is not None:  # the runtime's times do not depend on the predictor
        earlier = json.loads(args.reuse_measurements.read_text())
        by_label = {c["strategy"]: c["measured"] for r in earlier.get("models", []) if r["model"] == model
                    for c in r["candidates"]}
        best = {i: by_label[e.candidate.label] for i, e in enumerate(fitting) if e.candidate.label in by_label}
        print(f"{model}: {len(best)} of {len(fitting)} measurements reused from {args.reuse_measurements}")
    for round_ in range(args.rounds if len(best) < len(fitting) else 0):
        order = list(range(len(fitting)))
        if round_ % 2:
            order.reverse()
        for i in order:
            e = fitting[i]
            if args.reuse_measurements is not None and i in best:
                continue
            seconds, _ = measure_step(spec, e.candidate, report.regions, steps=args.steps, warmup=args.warmup)
            best[i] = min(best.get(i, float("inf")), seconds)
            print(f"  round {round_ + 1} {e.candidate.label:<52} predicted {e.predicted * 1e3:7.2f} ms  measured "
                  f"{seconds * 1e3:7.2f} ms", flush=True)
    predicted = [e.predicted for e in fitting]
    measured = [best[i] for i in range(len(fitting))]
    fastest = min(range(len(fitting)), key=lambda i: measured[i])
    rho = spearman(predicted, measured)
    return {
        "model": model, "devices": args.devices, "regions": report.regions, "space": report.space,
        "fit": len(fitting), "pick": fitting[0].candidate.label, "pick_predicted": predicted[0],
        "pick_measured": measured[0], "best": fitting[fastest].candidate.label, "best_measured": measured[fastest],
        "pick_over_best": measured[0] / measured[fastest], "spearman": rho,
        "pick_rank_measured": sorted(measured).index(measured[0]) + 1,
        "candidates": [{"strategy": e.candidate.label, "predicted": p, "measured": m, "peak_bytes": e.peak_bytes}
                       for e, p, m in zip(fitting, predicted, measured, strict=True)],
        "seconds": time.perf_counter() - started,
    }


def budget_case(args: argparse.Namespace) -> dict[str, object]:
    """A budget just under every ZeRO-0 candidate's estimate, the pipeline held at ``--budget-pp``."""
    kw = dict(stages=args.stages, microbatches=_microbatches(args.microbatch_range), schedules=args.schedules,
              zeros=(0, 1, 2, 3), pps=(args.budget_pp,), cache_dir=args.cache_dir)
    free = tune(args.budget_model, args.devices, **kw)
    zero0 = min(e.peak_bytes for e in free.result.fitting if e.candidate.zero == 0)
    budget = zero0 - 1
    report = tune(args.budget_model, args.devices, memory_budget_bytes=budget, **kw)
    pick = report.best
    spec = build_model(args.budget_model, stages=report.regions)
    seconds, peaks = measure_step(spec, pick.candidate, report.regions, steps=args.steps, warmup=args.warmup,
                                  memory_budget_bytes=budget)
    out = {"model": args.budget_model, "budget_bytes": budget, "smallest_zero0_bytes": zero0,
           "unconstrained_pick": free.best.candidate.label, "pick": pick.candidate.label,
           "pick_estimate_bytes": pick.peak_bytes, "pick_measured_peak_bytes": max(peaks), "pick_seconds": seconds,
           "over_budget": report.result.count("over budget")}
    print(f"budget case: {out}", flush=True)
    return out


def search_time(args: argparse.Namespace) -> dict[str, object]:
    """The search over the full space for ``--search-devices`` devices, on the transformer's
    measured profile with every variant's entries filled from the unsharded ones."""
    devices = args.search_devices
    regions = 2 * devices
    spec = build_model("transformer", stages=regions)
    captured = capture(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn)
    report = tune("transformer", 1, stages=regions, microbatches=(1, 2, 4, 8), schedules=("1f1b",), zeros=(0,),
                  cache_dir=args.cache_dir)
    profile: Profile = report.profile
    none = profile.compute["none"]
    filled = {"none": none}
    for k in range(2, devices + 1):
        if devices % k == 0:
            filled[f"tp{k}"] = none
            filled[f"ep{k}"] = none
    profile = attrs.evolve(profile, compute=filled)
    candidates = enumerate_space(devices, regions, microbatches=(1, 2, 4, 8, 16), weights=profile.region_weights())
    started = time.perf_counter()
    bounded = search(captured.graph, profile, candidates, shard=_Sharder(captured), keep=10)
    top10 = time.perf_counter() - started
    started = time.perf_counter()
    result = search(captured.graph, profile, candidates, shard=_Sharder(captured))
    seconds = time.perf_counter() - started
    same = [e.candidate for e in bounded.fitting[:10]] == [e.candidate for e in result.fitting[:10]]
    out = {"devices": devices, "regions": regions, "space": len(candidates), "fit": len(result.fitting),
           "invalid": result.count("invalid"), "exhaustive_seconds": seconds, "top10_seconds": top10,
           "top10_compiled": len(candidates) - bounded.count("dominated") - bounded.count("invalid"),
           "top10_same": same, "load_average": os.getloadavg()}
    print(f"search time: {out}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["transformer", "moe"])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatch-range", default="2,4")
    parser.add_argument("--zero-levels", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2])
    parser.add_argument("--schedules", type=lambda s: s.split(","), default=sorted(SCHEDULES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-model", default="transformer")
    parser.add_argument("--budget-pp", type=int, default=1)
    parser.add_argument("--search-devices", type=int, default=8)
    parser.add_argument("--skip", nargs="*", default=[], choices=["measure", "budget", "search"])
    parser.add_argument("--cache-dir", type=Path, default=Path(".bench-cache/tune"))
    parser.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    parser.add_argument("--reuse-measurements", type=Path, default=None,
                        help="a JSON written by --out: take the measured step times from it (e.g. after the "
                             "predictor changed) and measure only candidates it lacks")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("PIPER_REUSE_WORKERS", "1")
    results: dict[str, object] = {}
    ensure_ray(None, num_cpus=max(16, args.devices, args.search_devices))  # one cluster for every part
    try:
        if "search" not in args.skip:
            results["search"] = search_time(args)
        if "budget" not in args.skip:
            results["budget"] = budget_case(args)
        if "measure" not in args.skip:
            results["models"] = [measure_all(m, args) for m in args.models]
    finally:
        shutdown()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    print("\n| model | fitting candidates | tuned pick | its measured step (ms) | best measured | its step (ms) "
          "| pick / best | Spearman |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results.get("models", []):
        print(f"| {r['model']} | {r['fit']} | {r['pick']} | {r['pick_measured'] * 1e3:.1f} | {r['best']} | "
              f"{r['best_measured'] * 1e3:.1f} | {r['pick_over_best']:.2f} | {r['spearman']:.2f} |")


if __name__ == "__main__":
    main()
