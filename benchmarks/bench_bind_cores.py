"""Ranks bound to cores of their own vs left to the operating system (``bind_cores``).

The same Trainer configuration (``--schedule``, ``--pp``, ``--microbatches``, AdamW) runs
``--steps`` steps the way ``fit`` does (``Trainer.submit``, one step in flight ahead) with
``bind_cores=True`` and ``False``, alternating for ``--rounds`` rounds (pooled workers, so
both modes run on the same processes); each figure is the median time per step between
results on the driver, and "by round" the bound/unbound ratio of each round's medians.

    .venv/bin/python benchmarks/bench_bind_cores.py [--models mlp,stack] [--schedules 1f1b]
        [--pp 2] [--microbatches 8] [--steps 30] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from stepping import pipelined

from piper_runtime import OptimizerSpec
from piper_train.models import build_model
from piper_train.trainer import Trainer

CHUNKS = {"interleaved_1f1b": 2}


def steps_per_mode(model: str, schedule: str, pp: int, microbatches: int, steps: int, bind: bool, first: int) -> list[float]:
    """Seconds per step between results, ``steps`` pipelined steps after two warm-up steps."""
    spec = build_model(model, stages=pp * CHUNKS.get(schedule, 1))
    batches = [spec.batches(first + k) for k in range(steps + 2)]
    with Trainer.with_schedule(
        spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, schedule=schedule, pp=pp,
        microbatches=microbatches, optimizer=OptimizerSpec("adamw", 1e-3), reuse_workers=True, bind_cores=bind,
    ) as trainer:
        for batch in batches[:2]:
            trainer.step(*batch)
        return [seconds for seconds, _ in pipelined(trainer, batches[2:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,stack")
    parser.add_argument("--schedules", default="1f1b")
    parser.add_argument("--pp", type=int, nargs="+", default=[2])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    print(f"bind_cores on vs off: {os.cpu_count()} cores, {args.microbatches} microbatches, AdamW, "
          f"{args.rounds} alternating rounds; ms per step (median of each mode's steps)")
    print(f"{'model':8s} {'schedule':17s} {'pp':>3s} {'off ms':>8s} {'on ms':>8s} {'on/off':>7s}  {'by round':>11s}  load")
    for model in args.models.split(","):
        steps = args.steps if model == "mlp" else max(4, args.steps // 6)
        for schedule in args.schedules.split(","):
            for pp in args.pp:
                found: dict[bool, list[list[float]]] = {True: [], False: []}
                loads = [os.getloadavg()[0]]
                for r in range(args.rounds):
                    for bind in ((False, True) if r % 2 == 0 else (True, False)):
                        found[bind].append(steps_per_mode(model, schedule, pp, args.microbatches, steps, bind, 1000 * r))
                    loads.append(os.getloadavg()[0])
                on = statistics.median(t for ts in found[True] for t in ts)
                off = statistics.median(t for ts in found[False] for t in ts)
                rounds = [statistics.median(a) / statistics.median(b) for a, b in zip(found[True], found[False], strict=True)]
                print(f"{model:8s} {schedule:17s} {pp:3d} {off * 1e3:8.2f} {on * 1e3:8.2f} {on / off:7.2f}  "
                      f"{min(rounds):.2f}-{max(rounds):.2f}  {min(loads):.1f}-{max(loads):.1f}", flush=True)


if __name__ == "__main__":
    main()
