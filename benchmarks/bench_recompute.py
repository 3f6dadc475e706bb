"""Recomputation (``Recompute``): per-rank activation memory, estimated and measured, with
and without it, and the gradients of both runs compared.

The model is a transformer with long sequences (d_model 128, 4 heads, sequence 128, 4
blocks, one annotated region each), so activations dominate a rank's memory. 1F1B on two
pipeline ranks with 4 microbatches: rank 0 holds the forwards of up to two microbatches of
its two regions while their backwards wait; with ``Recompute({"PP": "*"})`` it holds only
their inputs, and one region's activations while its backward runs.

The estimate is ``piper_memory.estimate_memory`` with an activation profile
(``piper_train.profile.activation_bytes``: the bytes one forward keeps, measured once on one
process); the measurement is the runtime's ``RankMemory`` of the second step.

    .venv/bin/python benchmarks/bench_recompute.py [--seq 128] [--microbatch 4]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch

from piper_directives import Recompute, Strategy, build_schedule, capture
from piper_memory import estimate_memory, plan_memory
from piper_runtime import OptimizerSpec, Runtime
from piper_scheduler import compile_program
from piper_train.models import TinyTransformer, lm_loss
from piper_train.profile import activation_bytes

VOCAB, D_MODEL, HEADS, LAYERS, PP, MICROBATCHES = 256, 128, 4, 4, 2, 4
MIB = 2**20


def _mib(b: float) -> str:
    return f"{b / MIB:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatch", type=int, default=4, help="samples per microbatch")
    args = parser.parse_args()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TinyTransformer(VOCAB, D_MODEL, HEADS, LAYERS, args.seq)

    def batch(step: int) -> tuple[tuple[torch.Tensor], tuple[torch.Tensor]]:
        gen = torch.Generator().manual_seed(step)
        seq = torch.randint(0, VOCAB, (args.microbatch * MICROBATCHES, args.seq + 1), generator=gen)
        return (seq[:, :-1],), (seq[:, 1:],)

    captured = capture(model, *batch(0), lm_loss)
    base = build_schedule("1f1b", PP, MICROBATCHES, stages=LAYERS)
    runs = {}
    for name, strategy in (("keep", base), ("recompute", Strategy([*base.directives, Recompute({"PP": "*"})]))):
        program = compile_program(plan_memory(strategy.apply(captured.graph)))
        profile = activation_bytes(program, captured.modules, *batch(0))
        estimate = estimate_memory(program, "adamw", activation_bytes=profile)
        with Runtime(program, captured.modules, OptimizerSpec("adamw", 1e-3), step_timeout_s=600) as runtime:
            runtime.step(*batch(0), memory=True)
            result = runtime.step(*batch(1), keep_grads=True, memory=True)
        runs[name] = (estimate, result)
    print(f"transformer d_model {D_MODEL}, {HEADS} heads, seq {args.seq}, {LAYERS} blocks; 1F1B pp={PP}, "
          f"{MICROBATCHES} microbatches of {args.microbatch}; MiB, estimate / measured (second step)")
    print()
    print("| rank | activations, kept | activations, recomputed | peak, kept | peak, recomputed |")
    print("| --- | --- | --- | --- | --- |")
    for rank in range(PP):
        cells = []
        for what in ("activations", "total"):
            for name in ("keep", "recompute"):
                estimate, result = runs[name]
                cells.append(f"{_mib(estimate[rank].categories()[what])} / {_mib(getattr(result.memory[rank], what))}")
        print(f"| {rank} | " + " | ".join(cells) + " |")
    kept, recomputed = runs["keep"][1].grads, runs["recompute"][1].grads
    worst = max((kept[n] - recomputed[n]).abs().max().item() for n in kept)
    print()
    print(f"gradients of the second step, kept vs recomputed: largest |difference| {worst:.3e}")


if __name__ == "__main__":
    main()
