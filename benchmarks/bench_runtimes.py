"""The ``local`` runtime (every rank a thread of this process) against the ``ray`` runtime (one
Ray actor per rank): set-up cost and steady-state step, side by side in one run.

Each round starts a ``Trainer`` on each runtime in turn (alternating which goes first) in one
process: the set-up is the ``Trainer``'s construction (capture, compile, the ranks started and
set up; for Ray the first round also starts the embedded cluster, reported apart), then
``--steps`` steps one call each; the steady-state step is the median of the steps after the
first two. Both sides use AdamW with ``implementation="auto"`` (torch's fused kernel), the same
model, batches and strategy. Also checks that the two runtimes' losses are equal bit for bit.

    .venv/bin/python benchmarks/bench_runtimes.py [--model stack] [--schedule 1f1b] [--pp 2]
        [--microbatches 8] [--steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def run(runtime: str, model: str, schedule: str, pp: int, microbatches: int, steps: int) -> dict:
    from piper_directives import build_schedule
    from piper_runtime import OptimizerSpec
    from piper_train import Trainer
    from piper_train.models import build_model

    spec = build_model(model, stages=pp, seed=0)
    started = time.perf_counter()
    with Trainer(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn,
                 build_schedule(schedule, pp, microbatches), optimizer=OptimizerSpec("adamw", 1e-3),
                 runtime=runtime, reuse_workers=False) as trainer:
        setup = time.perf_counter() - started
        seconds, losses = [], []
        for step in range(steps):
            t0 = time.perf_counter()
            losses.append(trainer.step(*spec.batches(step)).losses)
            seconds.append(time.perf_counter() - t0)
    return {"setup": setup, "step": statistics.median(seconds[2:]), "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stack")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from piper_runtime import ensure_ray

    t0 = time.perf_counter()
    ensure_ray(num_cpus=16)
    ray_start = time.perf_counter() - t0
    print(f"embedded Ray cluster started in {ray_start:.2f} s (not in the set-up figures below)")
    rows: dict[str, list[dict]] = {"local": [], "ray": []}
    equal = True
    for r in range(args.rounds):
        order = ("local", "ray") if r % 2 == 0 else ("ray", "local")
        got = {name: run(name, args.model, args.schedule, args.pp, args.microbatches, args.steps) for name in order}
        equal &= got["local"]["losses"] == got["ray"]["losses"]
        for name in order:
            rows[name].append(got[name])
        print(f"round {r + 1} ({order[0]} first): " + "  ".join(
            f"{n}: set-up {got[n]['setup']:.2f} s, step {got[n]['step'] * 1e3:.1f} ms" for n in ("local", "ray")))
    med = {n: {k: statistics.median(x[k] for x in rows[n]) for k in ("setup", "step")} for n in rows}
    print(f"\n{args.model}, {args.schedule} pp={args.pp}, {args.microbatches} microbatches, AdamW (fused, both)")
    print("| runtime | set-up (s) | median steady step (ms) |")
    print("| --- | --- | --- |")
    for n in ("local", "ray"):
        print(f"| {n} | {med[n]['setup']:.2f} | {med[n]['step'] * 1e3:.1f} |")
    print(f"| local / ray | {med['local']['setup'] / med['ray']['setup']:.2f} | "
          f"{med['local']['step'] / med['ray']['step']:.2f} |")
    print(f"losses equal bit for bit in every round: {equal}")


if __name__ == "__main__":
    main()
