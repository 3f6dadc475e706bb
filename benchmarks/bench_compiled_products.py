"""A compiled backward's weight gradients added inside their products, against returned whole.

One stage segment of the ``stack`` model, compiled by inductor twice: once returning every
weight gradient whole, added into ``.grad`` as ``add_`` (what ``--compile`` did before), once
returning the 1 MiB weights' gradients as the two operands of their product, added with one
``addmm_`` (``piper_runtime.rank.compiled.WeightProduct``). A "step" is ``--microbatches``
forwards then their backwards into ``.grad`` (set to ``None`` first), on one thread, as a rank
runs them; the two alternate for ``--reps`` steps each; printed: the process's CPU time per
step (median and minimum) of each, and their ratios.

    .venv/bin/python benchmarks/bench_compiled_products.py [--microbatches 8] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from piper_directives import capture
from piper_runtime.options import MIN_WEIGHT_BYTES
from piper_runtime.rank.compiled import CompiledSegment, CompileStats, WeightProduct
from piper_train.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = build_model("stack", stages=2)
    captured = capture(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn)
    seg = next(s for s in captured.graph.segments if s.role.value == "stage")
    module = captured.modules[seg.id]
    (x,), _ = spec.batches(0)
    pieces = x.chunk(args.microbatches)
    out = module(pieces[0])
    g = torch.randn_like(out if isinstance(out, torch.Tensor) else out[0])
    params = list(module.parameters())
    large = [p for p in params if p.nbytes >= MIN_WEIGHT_BYTES]
    functions = {
        "whole": CompiledSegment(seg.id, module, [pieces[0]], [True], "inductor", CompileStats()),
        "products": CompiledSegment(seg.id, module, [pieces[0]], [True], "inductor", CompileStats(), fused=large),
    }

    def step(fn: CompiledSegment) -> None:
        for p in params:
            p.grad = None
        saved = [fn.forward([piece])[1] for piece in pieces]
        for residuals in saved:
            _, weights = fn.backward(list(residuals), fn.tangents([g]))
            for p, w in zip(fn.params, weights, strict=True):
                if isinstance(w, WeightProduct):
                    w.add_into(p)
                elif w is not None:
                    p.grad = w.clone() if p.grad is None else p.grad.add_(w)

    for fn in functions.values():  # compiles B, warms caches
        step(fn)
        step(fn)
    cpu: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(args.reps):
        for name, fn in functions.items():
            started = time.process_time()
            step(fn)
            cpu[name].append(time.process_time() - started)
    print(f"stack, segment {seg.id}: {args.microbatches} microbatches of {tuple(pieces[0].shape)} forward then "
          f"backward, one thread, {len(large)} weights of >= {MIN_WEIGHT_BYTES >> 20} MiB, {args.reps} alternated "
          "steps each; CPU ms per step:")
    for name, t in cpu.items():
        print(f"  {name:<9} median {statistics.median(t) * 1e3:7.1f}  min {min(t) * 1e3:7.1f}")
    print(f"  products / whole: median {statistics.median(cpu['products']) / statistics.median(cpu['whole']):.3f}, "
          f"min {min(cpu['products']) / min(cpu['whole']):.3f}")


if __name__ == "__main__":
    main()
