"""Seconds from a process's start to its first training step, side by side in one run: the
``ray`` runtime with its rank workers prestarted by the embedded cluster's raylet (the
default), the same without (``prestart_workers=False``), and the ``local`` runtime.

Each run is a fresh Python process (the count starts with the interpreter, as ``piper
train``'s "first step done" line does: ``piper_train.startup.process_seconds``) that imports
Piper, builds ``piper train``'s default model (``lm``: 2 regions), starts a ``Trainer`` on
1F1B over 2 ranks with 4 microbatches and AdamW (Piper's default implementation, torch's
fused kernel), and takes one step. Rounds alternate the order of the configurations; the
table gives each one's median, range, and its median over the non-prestarted Ray runs'.

    .venv/bin/python benchmarks/bench_first_step.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = {
    "ray, prestarted": {"runtime": "ray", "prestart_workers": True},
    "ray, not prestarted": {"runtime": "ray", "prestart_workers": False},
    "local": {"runtime": "local", "prestart_workers": True},
}
BASELINE = "ray, not prestarted"

CHILD = """
import json, sys
settings = json.loads(sys.argv[1])
from piper_train.startup import process_seconds
from piper_directives import build_schedule
from piper_runtime import OptimizerSpec
from piper_train import Trainer
from piper_train.models import build_model

spec = build_model("lm", stages=2, seed=0)
with Trainer(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, build_schedule("1f1b", 2, 4),
             optimizer=OptimizerSpec("adamw", 3e-3), reuse_workers=False, **settings) as trainer:
    up = process_seconds()
    trainer.step(*spec.batches(0))
    first = process_seconds()
print(json.dumps({"up": up, "first": first}))
"""


def once(settings: dict) -> dict:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(settings)], capture_output=True, text=True,
                          timeout=300, env=env)
    if done.returncode != 0:
        raise SystemExit(f"a run failed ({settings}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            results[name].append(once(CONFIGS[name]))
            print(f"round {r + 1}: {name}: first step at {results[name][-1]['first']:.2f} s", flush=True)
    base = statistics.median(run["first"] for run in results[BASELINE])
    print(f"\nfirst step of a Trainer, seconds from the process's start (lm, 1f1b, pp=2, 4 microbatches), "
          f"{args.rounds} alternated rounds, load {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':<22} {'ranks up s':>10} {'first step s':>12} {'range':>12} {'/ ' + BASELINE:>24}")
    for name, runs in results.items():
        firsts = [run["first"] for run in runs]
        median = statistics.median(firsts)
        print(f"{name:<22} {statistics.median(run['up'] for run in runs):>10.2f} {median:>12.2f} "
              f"{min(firsts):>5.2f}-{max(firsts):<6.2f} {median / base:>24.2f}")


if __name__ == "__main__":
    main()
