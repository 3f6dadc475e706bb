"""A step's batches inside the call against through Ray's object store, under ``fit``.

Ray puts a call's argument above ``max_direct_call_object_size`` (100 KiB by default) into
its object store, where the raylet creates, seals, pins and frees it; ``ensure_ray`` raises
that limit (``piper_runtime.driver.cluster.INLINE_ENV``) so a step's batches travel inside the call
to each worker. The setting is read when the driver starts Ray, so each round runs one fresh
process per setting (alternating which goes first): a ``Trainer`` under ``fit`` (its
automatic call sizes, as ``piper train`` runs, or ``--steps-per-call``), timing the steps
after the first few (``StepMetrics.step_seconds``), and the CPU time per step of the ranks,
the driver and the raylet (``/proc``). Prints each round, then the medians and inline /
object store.

    .venv/bin/python benchmarks/bench_inline_batches.py [--model stack] [--schedule 1f1b] [--pp 2]
        [--microbatches 8] [--steps 40] [--rounds 4] [--steps-per-call auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from stepping import cpu_seconds, trainer_arguments

RAY_DEFAULTS = {  # Ray's own limits: larger arguments go through the object store
    "RAY_max_direct_call_object_size": str(100 * 1024),
    "RAY_task_rpc_inlined_bytes_limit": str(10 << 20),
}
SETTINGS = ("inline", "object store")
WARM = 4  # fit's first steps: single calls while it measures the pace


def _raylet_pids() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == "raylet":
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def child(model: str, schedule: str, pp: int, microbatches: int, steps: int, per_call: str) -> dict[str, float]:
    """One setting in this process: median step seconds and CPU seconds per step."""
    import ray

    from piper_runtime import OptimizerSpec
    from piper_train.call_size import parse_steps_per_call
    from piper_train.loop import fit
    from piper_train.models import build_model
    from piper_train.trainer import Trainer

    spec = build_model(model, stages=pp)
    batches = [spec.batches(s) for s in range(WARM + steps)]
    with Trainer.with_schedule(
        spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, schedule=schedule, pp=pp,
        microbatches=microbatches, optimizer=OptimizerSpec("adamw", 1e-3),
    ) as trainer:
        ranks = ray.get([w.ping.remote() for w in trainer.runtime._workers], timeout=60)
        watched = {"ranks": ranks, "driver": [os.getpid()], "raylet": _raylet_pids()}
        before = {k: sum(cpu_seconds(p) for p in pids) for k, pids in watched.items()}
        run = fit(trainer, iter(batches), steps=len(batches), steps_per_call=parse_steps_per_call(per_call))
        used = {k: sum(cpu_seconds(p) for p in pids) - before[k] for k, pids in watched.items()}
    return {"step": statistics.median(m.step_seconds for m in run.steps[WARM:]),
            **{f"{k} cpu": v / len(batches) for k, v in used.items()}}


def main() -> None:
    parser = trainer_arguments(__doc__.splitlines()[0], model="stack", steps=40)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps-per-call", default="auto", help="fit's steps_per_call: auto or a number")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.schedule, args.pp, args.microbatches, args.steps, args.steps_per_call)))
        return
    print(f"{args.model}, {args.schedule}, pp={args.pp}, {args.microbatches} microbatches, fit with "
          f"{args.steps_per_call} steps per call, {args.steps} timed "
          f"steps per process; load {os.getloadavg()[0]:.1f}")
    print(f"{'round':>5} {'setting':>13} {'step ms':>8} {'ranks cpu':>10} {'driver cpu':>11} {'raylet cpu':>11}")
    results: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
            env = {**os.environ, **(RAY_DEFAULTS if setting == "object store" else {})}
            cmd = [sys.executable, __file__, "--child", setting, "--model", args.model, "--schedule", args.schedule,
                   "--pp", str(args.pp), "--microbatches", str(args.microbatches), "--steps", str(args.steps),
                   "--steps-per-call", args.steps_per_call]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=900).stdout
            got = json.loads(out.strip().splitlines()[-1])
            results[setting].append(got)
            print(f"{r:>5} {setting:>13} {got['step'] * 1e3:>8.1f} {got['ranks cpu'] * 1e3:>10.1f} "
                  f"{got['driver cpu'] * 1e3:>11.1f} {got['raylet cpu'] * 1e3:>11.1f}", flush=True)
    med = {s: {k: statistics.median(g[k] for g in results[s]) for k in results[s][0]} for s in SETTINGS}
    ratios = [a["step"] / b["step"] for a, b in zip(results["inline"], results["object store"], strict=True)]
    for s in SETTINGS:
        m = med[s]
        print(f"median {s}: step {m['step'] * 1e3:.1f} ms; CPU per step: ranks {m['ranks cpu'] * 1e3:.1f} ms, "
              f"driver {m['driver cpu'] * 1e3:.1f} ms, raylet {m['raylet cpu'] * 1e3:.1f} ms")
    print(f"inline / object store, step: {med['inline']['step'] / med['object store']['step']:.3f} "
          f"(rounds {min(ratios):.3f}-{max(ratios):.3f}); load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
