"""A loss's backward run through its stage in one pass, against the two passes apart.

The runtime fuses a loss's ``B`` with the ``B`` of the stage that feeds it where the plan
puts them one after the other (``piper_runtime.compute.fused_losses``); ``Trainer(...,
fuse_loss_backward=False)`` keeps them apart. This runs one model and schedule both ways,
alternating rounds (fused, apart, apart, fused, ...), each a Trainer on the same reused
workers. It prints, per setting, the median of the pipelined step time (one step in flight
ahead, as ``fit`` runs) and of the slowest rank's time inside its step; then the median of
the rounds' fused/apart ratios.

    .venv/bin/python benchmarks/bench_loss_fusion.py [--model mlp] [--schedule 1f1b] [--pp 2]
        [--microbatches 8] [--steps 20] [--rounds 6]
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from stepping import pipelined, trainer_arguments

from piper_runtime import OptimizerSpec
from piper_train.models import build_model
from piper_train.trainer import Trainer


def run(spec, schedule: str, pp: int, microbatches: int, steps: int, fuse: bool) -> tuple[float, float]:
    """Median pipelined step time and median in-worker time (slowest rank), in seconds."""
    with Trainer.with_schedule(
        spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, schedule=schedule, pp=pp,
        microbatches=microbatches, optimizer=OptimizerSpec("adamw", 1e-3), reuse_workers=True,
        fuse_loss_backward=fuse,
    ) as trainer:
        batches = [spec.batches(s) for s in range(steps + 2)]
        trainer.step(*batches[0])  # warm-up
        stepped = pipelined(trainer, batches[1:])[1:]  # the first: from its submission
    return (statistics.median(seconds for seconds, _ in stepped),
            statistics.median(max(result.worker_seconds) for _, result in stepped))


def main() -> None:
    parser = trainer_arguments(__doc__.splitlines()[0], steps=20)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    spec = build_model(args.model, stages=args.pp)
    print(f"{args.model}, {args.schedule}, pp={args.pp}, {args.microbatches} microbatches, AdamW; "
          f"{args.steps} pipelined steps per round; load {os.getloadavg()[0]:.1f}")
    print(f"{'round':>5} {'fused ms':>9} {'in-worker':>10} {'apart ms':>9} {'in-worker':>10} {'fused/apart':>12}")
    ratios, inside_ratios = [], []
    for r in range(args.rounds):
        result = {}
        for fuse in (True, False) if r % 2 == 0 else (False, True):
            result[fuse] = run(spec, args.schedule, args.pp, args.microbatches, args.steps, fuse)
        (f, fi), (a, ai) = result[True], result[False]
        ratios.append(f / a)
        inside_ratios.append(fi / ai)
        print(f"{r:>5} {f * 1e3:>9.2f} {fi * 1e3:>10.2f} {a * 1e3:>9.2f} {ai * 1e3:>10.2f} {f / a:>12.3f}", flush=True)
    print(f"median fused/apart: pipelined {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}), "
          f"in-worker {statistics.median(inside_ratios):.3f} ({min(inside_ratios):.3f}-{max(inside_ratios):.3f}); "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
