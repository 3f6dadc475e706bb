"""Piper vs ``torch.distributed.pipelining``: the same model, data, ranks and schedule.

Both sides run on gloo over loopback, one CPU thread per rank, SGD, ``pp`` ranks and
``microbatches`` microbatches. torch's side times each step between barriers on rank 0
(``torch_pipelining.py``); Piper's side times ``Trainer.step`` from the driver, so its
figure also includes handing the batch to the Ray workers and collecting the losses, and
reports the slowest rank's time inside its step ("in-worker"), the figure comparable to
torch's barrier-to-barrier time. Piper runs with one thread per stream (its default); the last
column is the same plan walked sequentially by one thread per rank (``threads=False``).

    .venv/bin/python benchmarks/bench_pipeline.py [--pp 2] [--microbatches 4] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from torch_pipelining import run_torch_pipeline

from piper_runtime import OptimizerSpec
from piper_train.models import build_model
from piper_train.trainer import Trainer


def run_piper(
    schedule: str, model_name: str, pp: int, microbatches: int, steps: int, warmup: int = 2, threads: bool = True
) -> tuple[list[float], list[float]]:
    """Step times from the driver, and the slowest rank's time inside its step."""
    spec = build_model(model_name, stages=pp)
    with Trainer.with_schedule(
        spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn,
        schedule=schedule, pp=pp, microbatches=microbatches, optimizer=OptimizerSpec("sgd", 0.01),
        threads=threads,
    ) as trainer:
        times, inside = [], []
        for step in range(warmup + steps):
            inputs, targets = spec.batches(step)
            start = time.perf_counter()
            result = trainer.step(inputs, targets)
            if step >= warmup:
                times.append(time.perf_counter() - start)
                inside.append(max(result.worker_seconds))
    return times, inside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", default="mlp,transformer,lm")
    args = parser.parse_args()
    print(f"Piper vs torch.distributed.pipelining — gloo/CPU, pp={args.pp}, {args.microbatches} microbatches, "
          f"median of {args.steps} steps after 2 warm-up steps")
    header = (f"{'model':<12} {'schedule':<8} {'torch ms':>9} {'piper ms':>9} {'piper/torch':>12}"
              f" {'in-worker ms':>13} {'in-worker/torch':>16} {'sequential/torch':>17}")
    print(header)
    print("-" * len(header))
    for model_name in args.models.split(","):
        for schedule in ("gpipe", "1f1b"):
            torch_ms = 1000 * statistics.median(run_torch_pipeline(schedule, model_name, args.pp, args.microbatches, args.steps))
            times, inside = run_piper(schedule, model_name, args.pp, args.microbatches, args.steps)
            _, serial = run_piper(schedule, model_name, args.pp, args.microbatches, args.steps, threads=False)
            piper_ms, inside_ms = 1000 * statistics.median(times), 1000 * statistics.median(inside)
            serial_ms = 1000 * statistics.median(serial)
            print(f"{model_name:<12} {schedule:<8} {torch_ms:>9.2f} {piper_ms:>9.2f} {piper_ms / torch_ms:>12.2f}"
                  f" {inside_ms:>13.2f} {inside_ms / torch_ms:>16.2f} {serial_ms / torch_ms:>17.2f}", flush=True)


if __name__ == "__main__":
    main()
