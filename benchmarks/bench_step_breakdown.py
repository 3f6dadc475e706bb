"""Where a Piper step's time goes, before and after taking the fixed costs off the hot path.

One Trainer (1F1B, AdamW, ``--pp`` ranks, ``--microbatches``) runs the same steps two ways,
alternating, with ``profile=True`` (every instruction's start and end inside its worker):

- ``before``: ``Trainer.step`` one call at a time with memory accounting on every step (how
  the runtime ran before accounting became opt-in and steps could be submitted ahead);
- ``after``: ``Trainer.submit`` with one step in flight ahead, no memory accounting (what
  ``fit`` does on all but a few steps).

Per step, summed over the instructions of the rank with the longest step (medians over the
timed steps of each mode):

- driver round trip + batch hand-over: the driver's time per step minus the slowest rank's
  time inside its step (for ``after``: between results, so it is only what is left exposed);
- startup: inside the worker, before its first instruction (taking the batch, splitting it);
- compute (forward/backward) and optimizer: the instructions' own durations;
- receive waits: RECV instructions (waiting for the peer plus completing the transfer);
- sends: posting them; tail: waiting for the step's sends after the last instruction;
- bookkeeping + hand-offs: the gaps between one instruction's end and the next one's start
  on the rank (dropping values, posting receives, memory samples, waking another lane's
  thread, waiting for the GIL).

    .venv/bin/python benchmarks/bench_step_breakdown.py [--model stack] [--pp 2] [--microbatches 8] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from stepping import pipelined

from piper_ir import NodeKind, Program
from piper_runtime import OptimizerSpec, StepResult
from piper_train.models import build_model
from piper_train.trainer import Trainer

PARTS = ("driver", "startup", "compute", "optimizer", "recv", "send", "tail", "gaps")
LABELS = {
    "driver": "driver round trip + batch hand-over",
    "startup": "startup (batch split)",
    "compute": "compute (F/B)",
    "optimizer": "optimizer",
    "recv": "receive waits",
    "send": "posting sends",
    "tail": "tail (waiting for sends)",
    "gaps": "bookkeeping + hand-offs (gaps)",
}


def breakdown(program: Program, result: StepResult, driver_s: float) -> dict[str, float]:
    """Seconds per part for the rank with the longest step."""
    kinds = {(plan.rank, ins.id): ins.kind for plan in program.ranks for ins in plan.instructions}
    rank = max(range(len(result.worker_seconds)), key=lambda r: result.worker_seconds[r])
    mine = sorted((t for t in result.timings if t.rank == rank), key=lambda t: t.start)
    out = dict.fromkeys(PARTS, 0.0)
    out["driver"] = driver_s - result.worker_seconds[rank]
    out["startup"] = mine[0].start
    out["tail"] = result.worker_seconds[rank] - max(t.end for t in mine)
    reach = mine[0].start
    for t in mine:
        out["gaps"] += max(0.0, t.start - reach)
        reach = max(reach, t.end)
        kind = kinds[(rank, t.instruction)]
        part = {NodeKind.COMPUTE: "compute", NodeKind.OPTIMIZER: "optimizer", NodeKind.RECV: "recv",
                NodeKind.SEND: "send"}.get(kind, "compute")
        out[part] += t.end - t.start
    out["total"] = driver_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stack")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    spec = build_model(args.model, stages=args.pp)
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    loads = [os.getloadavg()[0]]
    with Trainer.with_schedule(
        spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, schedule="1f1b", pp=args.pp,
        microbatches=args.microbatches, optimizer=OptimizerSpec("adamw", 1e-3), reuse_workers=True,
    ) as trainer:
        program = trainer.program
        step = 0
        trainer.step(*spec.batches(step))  # warm-up
        for _ in range(args.rounds):
            for mode in ("before", "after"):
                batches = [spec.batches(step + k) for k in range(args.steps)]
                step += args.steps
                if mode == "before":
                    for batch in batches:
                        t0 = time.perf_counter()
                        result = trainer.step(*batch, profile=True, memory=True)
                        rows[mode].append(breakdown(program, result, time.perf_counter() - t0))
                else:
                    for seconds, result in pipelined(trainer, batches, profile=True):
                        rows[mode].append(breakdown(program, result, seconds))
                loads.append(os.getloadavg()[0])
    print(f"Step breakdown: {args.model}, 1F1B, pp={args.pp}, {args.microbatches} microbatches, AdamW; ms per step "
          f"on the slowest rank, medians of {args.steps * args.rounds} steps per mode; load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    print("| part | before (ms) | after (ms) |\n|---|---|---|")
    for part in (*PARTS, "total"):
        before = statistics.median(r[part] for r in rows["before"]) * 1e3
        after = statistics.median(r[part] for r in rows["after"]) * 1e3
        print(f"| {LABELS.get(part, 'step (driver)')} | {before:.2f} | {after:.2f} |")


if __name__ == "__main__":
    main()
