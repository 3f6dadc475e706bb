"""Checkpoints written while training goes on (``Checkpoints(asynchronous=True)``, ``piper
train --checkpoint-async``) against checkpoints the steps wait for, side by side.

``--model`` (default ``stack``: 8 residual blocks, d=256, hidden 1024, 4.2 M parameters, so a
checkpoint with AdamW's two moments is about 50 MB) trains under 1F1B on ``--pp`` ranks for
``--steps`` steps with a checkpoint every ``--every``, in alternating rounds of each mode
(one Trainer per mode, its workers reused across rounds). Per mode it prints the median
over rounds of: the run's seconds per step (checkpoints included), the seconds the steps
waited per checkpoint, and each checkpoint's seconds from start to rename; then the
ratios. No timing is asserted anywhere: this is a measurement (docs/checkpoints.md).

    .venv/bin/python benchmarks/bench_checkpoint_async.py [--rounds 3] [--steps 24 --every 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from piper_directives import build_schedule
from piper_runtime import OptimizerSpec, ensure_ray, shutdown
from piper_train.checkpoints import Checkpoints
from piper_train.loop import fit
from piper_train.metrics import CheckpointMetrics
from piper_train.models import build_model
from piper_train.trainer import Trainer


class Written:
    """A sink that keeps every checkpoint's figures."""

    def __init__(self) -> None:
        self.checkpoints: list[CheckpointMetrics] = []

    def on_step(self, metrics, result) -> None:
        pass

    def on_eval(self, metrics) -> None:
        pass

    def on_checkpoint(self, metrics: CheckpointMetrics) -> None:
        self.checkpoints.append(metrics)

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stack")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ensure_ray(num_cpus=4 * args.pp)  # two trainers held at once (logical CPUs)
    workload = build_model(args.model, stages=args.pp)
    strategy = build_schedule("1f1b", args.pp, args.microbatches, stages=args.pp)
    modes = {"waited for": False, "written meanwhile": True}
    runs: dict[str, list[float]] = {m: [] for m in modes}
    waited: dict[str, list[float]] = {m: [] for m in modes}
    whole: dict[str, list[float]] = {m: [] for m in modes}
    sizes: list[int] = []
    trainers = {m: Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
                           strategy, optimizer=OptimizerSpec("adamw", 1e-3)) for m in modes}
    try:
        for _ in range(args.rounds):
            for mode, asynchronous in modes.items():
                trainer = trainers[mode]
                end = trainer.state.step + args.steps  # each round goes on from the last, into a folder of its own
                sink = Written()
                with tempfile.TemporaryDirectory(prefix="piper-ckpt-") as root:
                    started = time.perf_counter()
                    fit(trainer, workload.stream(), steps=end, sinks=[sink],
                        checkpoints=Checkpoints(Path(root), args.every, keep=2, asynchronous=asynchronous))
                    runs[mode].append((time.perf_counter() - started) / args.steps)
                periodic = [c for c in sink.checkpoints if c.step < end]  # the last one is waited for
                waited[mode] += [c.waited_seconds for c in periodic]
                whole[mode] += [c.seconds for c in periodic]
                sizes += [c.bytes for c in sink.checkpoints]
    finally:
        for trainer in trainers.values():
            trainer.close()
        shutdown()
    print(f"{args.model}, 1F1B pp={args.pp}, {args.microbatches} microbatches, AdamW, {args.steps} steps, a "
          f"checkpoint every {args.every} ({statistics.median(sizes) / 2**20:.1f} MiB each), {args.rounds} rounds, "
          f"medians; load {os.getloadavg()[0]:.1f}")
    print(f"{'checkpoints':<18} {'s/step (run)':>13} {'steps waited s/ckpt':>20} {'ckpt start->rename s':>21}")
    for mode in modes:
        print(f"{mode:<18} {statistics.median(runs[mode]):13.4f} {statistics.median(waited[mode]):20.4f} "
              f"{statistics.median(whole[mode]):21.4f}")
    a, s = "written meanwhile", "waited for"
    print(f"meanwhile / waited for: run {statistics.median(runs[a]) / statistics.median(runs[s]):.2f}, "
          f"steps' wait per checkpoint {statistics.median(waited[a]) / statistics.median(waited[s]):.2f}")


if __name__ == "__main__":
    main()
