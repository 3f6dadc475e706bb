"""One of the runtime's fusions on, against it off: the same model, schedule and workers.

``--fusion loss``: a loss's ``B`` run with the ``B`` of the stage that feeds it, in one
pass, where the plan puts them one after the other (``piper_runtime.rank.compute.fused_losses``;
off: ``Trainer(..., fuse_loss_backward=False)``). ``--fusion grads``: each microbatch's
``nn.Linear`` weight gradient added into ``.grad`` by the matrix product that computes it
for weights of ``--min-bytes`` or more (default ``MIN_WEIGHT_BYTES``, 1 MiB: the runtime's
default; off: ``grad_fusion_min_bytes=None``, autograd adds every one). ``--width D,H`` runs
the ``stack`` model's residual blocks at ``d_model`` D and hidden width H instead of a
built-in model (``--blocks`` of them, batch ``--batch`` x 32 positions). ``--fusion
input-grads-first``: a stage's last backward of the step sends its input gradient before its
fused layers' weight products are added (``piper_runtime.rank.input_grads_first``; off: ``input_grads_first=False``,
the products inside the pass; both with the ``grads`` fusion from ``--min-bytes``).

This runs one model and schedule both ways, alternating rounds (fused, apart, apart, fused,
...), each a Trainer on the same reused workers. It prints, per setting, the median of the
pipelined step time (one step in flight ahead, as ``fit`` runs) and of the slowest rank's
time inside its step; then the median of the rounds' fused/apart ratios.

    .venv/bin/python benchmarks/bench_fusion.py [--fusion loss|grads|input-grads-first] [--model mlp]
        [--schedule 1f1b] [--pp 2] [--microbatches 8] [--steps 20] [--rounds 6]
        [--width 1024,4096 --blocks 4 --batch 16] [--min-bytes 4194304]
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.nn.functional as F
from stepping import pipelined, trainer_arguments

from piper_runtime import OptimizerSpec
from piper_runtime.rank.accumulation import MIN_WEIGHT_BYTES
from piper_train.models import ResidualStack, build_model
from piper_train.trainer import Trainer

FLAGS = {"loss": "fuse_loss_backward", "grads": "grad_fusion_min_bytes", "input-grads-first": "input_grads_first"}
SEQ = 32


class Wide:
    """The ``stack`` model's blocks at another width, with ``build_model``'s fields that ``run`` reads."""

    def __init__(self, d_model: int, hidden: int, blocks: int, regions: int, batch: int) -> None:
        torch.manual_seed(0)
        self.model = ResidualStack(d_model, hidden, blocks, regions)
        self.d_model, self.batch = d_model, batch
        self.loss_fn = F.mse_loss
        (self.example_inputs, self.example_targets) = self.batches(0)

    def batches(self, step: int) -> tuple[tuple[torch.Tensor], tuple[torch.Tensor]]:
        x = torch.randn(self.batch, SEQ, self.d_model, generator=torch.Generator().manual_seed(step))
        return (x,), (torch.tanh(x),)


def run(spec, schedule: str, pp: int, microbatches: int, steps: int, setting: dict) -> tuple[float, float]:
    """Median pipelined step time and median in-worker time (slowest rank), in seconds."""
    with Trainer.with_schedule(
        spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, schedule=schedule, pp=pp,
        microbatches=microbatches, optimizer=OptimizerSpec("adamw", 1e-3), reuse_workers=True,
        **setting,
    ) as trainer:
        batches = [spec.batches(s) for s in range(steps + 2)]
        trainer.step(*batches[0])  # warm-up
        stepped = pipelined(trainer, batches[1:])[1:]  # the first: from its submission
    return (statistics.median(seconds for seconds, _ in stepped),
            statistics.median(max(result.worker_seconds) for _, result in stepped))


def main() -> None:
    parser = trainer_arguments(__doc__.splitlines()[0], steps=20)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--fusion", choices=sorted(FLAGS), default="loss")
    parser.add_argument("--width", help="D,H: the stack model's blocks at d_model D and hidden width H")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--min-bytes", type=int, default=MIN_WEIGHT_BYTES)
    args = parser.parse_args()
    flag = FLAGS[args.fusion]
    settings = {
        "loss": {True: {flag: True}, False: {flag: False}},
        "grads": {True: {flag: args.min_bytes}, False: {flag: None}},
        "input-grads-first": {fuse: {flag: fuse, "grad_fusion_min_bytes": args.min_bytes} for fuse in (True, False)},
    }[args.fusion]
    if args.width:
        d_model, hidden = (int(v) for v in args.width.split(","))
        spec = Wide(d_model, hidden, args.blocks, args.pp, args.batch)
        what = (f"stack blocks d_model {d_model}, hidden {hidden}, {args.blocks} blocks, batch {args.batch} x {SEQ} "
                f"({d_model * hidden * 4 / 2**20:g} MiB weights)")
    else:
        spec, what = build_model(args.model, stages=args.pp), args.model
    fused_from = f", from {args.min_bytes / 2**20:g} MiB" if args.fusion != "loss" else ""
    print(f"{args.fusion} fusion ({flag}{fused_from}); {what}, {args.schedule}, pp={args.pp}, "
          f"{args.microbatches} microbatches, AdamW; {args.steps} pipelined steps per round; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'round':>5} {'fused ms':>9} {'in-worker':>10} {'apart ms':>9} {'in-worker':>10} {'fused/apart':>12}")
    ratios, inside_ratios = [], []
    for r in range(args.rounds):
        result = {}
        for fuse in (True, False) if r % 2 == 0 else (False, True):
            result[fuse] = run(spec, args.schedule, args.pp, args.microbatches, args.steps, settings[fuse])
        (f, fi), (a, ai) = result[True], result[False]
        ratios.append(f / a)
        inside_ratios.append(fi / ai)
        print(f"{r:>5} {f * 1e3:>9.2f} {fi * 1e3:>10.2f} {a * 1e3:>9.2f} {ai * 1e3:>10.2f} {f / a:>12.3f}", flush=True)
    print(f"median fused/apart: pipelined {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}), "
          f"in-worker {statistics.median(inside_ratios):.3f} ({min(inside_ratios):.3f}-{max(inside_ratios):.3f}); "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
