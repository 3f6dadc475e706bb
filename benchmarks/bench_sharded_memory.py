"""Per-rank activation and parameter memory, and bytes communicated per step, under tensor
parallelism with and without sequence parallelism and a vocabulary-parallel head, and under
context parallelism (issue 37, item 8), measured on the runtime against ``piper_memory``'s
estimate.

examples/llama (dim 64, 4 layers in 4 regions, 4 query heads, 2 key/value heads, vocabulary 256,
batch 8 x 64 tokens, float32) trains one step on the local runtime (every rank a thread of this
process), one pipeline stage, 2 microbatches, AdamW, per configuration:

- *measured*: ``RankMemory`` of rank 0 (``step(memory=True)``): ``activations`` (the peak of
  the tensors the forwards keep for their backwards) and ``parameters``; and the bytes each
  rank hands to the collectives inside its segments per step, counted in ring terms as NCCL's
  algorithms send them (all-reduce ``2(n-1)/n B``, reduce-scatter ``(n-1)/n B``, all-gather
  ``(n-1) b``; B the whole tensor, b a rank's piece), averaged over the ranks;
- *estimate*: ``estimate_memory`` of the compiled program with the activation bytes ``piper
  tune`` profiles: one rank of the variant (``rank_activation_bytes``), and, for comparison,
  one device's (what the estimate used for every variant before) and none (the IR-only
  default: segment outputs); the bytes ``piper_scheduler.costs.sharded_collectives`` prices
  on a link of 1 byte/s (seconds = bytes a rank sends), summed over rank 0's instructions.

    .venv/bin/python benchmarks/bench_sharded_memory.py [--seq 64] [--batch 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from piper_directives import build_schedule, capture, context_parallel, parallelize
from piper_directives.collective_code import GroupCollectives
from piper_memory import estimate_memory
from piper_runtime import OptimizerSpec
from piper_scheduler import Link
from piper_scheduler.costs import sharded_collectives
from piper_train.trainer import Trainer
from piper_train.tuning.profiler import rank_activation_bytes

ROOT = Path(__file__).resolve().parents[1]
#: Only the blocks' Linears cut: the embedding and the head whole (no vocabulary parallelism).
BLOCKS = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise",
          "layers.*.attention.wo": "rowwise", "layers.*.feed_forward.w1": "colwise",
          "layers.*.feed_forward.w3": "colwise", "layers.*.feed_forward.w2": "rowwise"}
#: (label, variant, tp, sp, cp, plan)
CONFIGS = [
    ("one device", "none", 1, False, 1, None),
    ("tp=2, head whole", "tp2", 2, False, 1, BLOCKS),
    ("tp=2", "tp2", 2, False, 1, None),
    ("tp=2 sp", "tp2sp", 2, True, 1, None),
    ("tp=4", "tp4", 4, False, 1, None),
    ("tp=4 sp", "tp4sp", 4, True, 1, None),
    ("cp=2", "cp2", 1, False, 2, None),
    ("cp=4", "cp4", 1, False, 4, None),
]
MICROBATCHES = 2


def _llama(seq: int, batch: int):
    spec = importlib.util.spec_from_file_location("piper_example_llama_bench", ROOT / "examples" / "llama" / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.make(module.ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=seq), batch=batch,
                       seq_len=seq)


class _Counter:
    """Bytes handed to in-segment collectives (``GroupCollectives.timed``), in ring terms."""

    def __init__(self) -> None:
        self.sent = 0.0
        self.original = GroupCollectives.timed

    def __enter__(self) -> _Counter:
        counter = self

        def timed(module, collective, *args, **kwargs):
            n, name = module.degree, getattr(collective, "__name__", "")
            if name == "all_reduce":
                counter.sent += 2 * (n - 1) / n * args[0].numel() * args[0].element_size()
            elif name == "all_gather":  # (out, piece)
                counter.sent += (n - 1) * args[1].numel() * args[1].element_size()
            elif name == "reduce_scatter":  # (out, whole)
                counter.sent += (n - 1) / n * args[1].numel() * args[1].element_size()
            return counter.original(module, collective, *args, **kwargs)

        GroupCollectives.timed = timed
        return self

    def __exit__(self, *exc) -> None:
        GroupCollectives.timed = self.original


def run(config, seq: int, batch: int) -> dict[str, float]:
    label, variant, tp, sp, cp, plan = config
    model, inputs, targets, loss_fn, _ = _llama(seq, batch)
    regions = 4
    strategy = context_parallel(parallelize(build_schedule("1f1b", 1, MICROBATCHES, stages=regions), tp=tp, sp=sp,
                                            tp_plan=plan), cp)
    with Trainer(model, inputs, targets, loss_fn, strategy, optimizer=OptimizerSpec("adamw", 1e-3),
                 runtime="local") as trainer:
        program = trainer.program
        trainer.step(inputs, targets)  # warm: the optimizer's state exists from the first step on
        with _Counter() as counter:
            measured = trainer.step(inputs, targets, memory=True).memory
    captured = capture(model, inputs, targets, loss_fn)  # as piper tune captures it
    inputs, targets = (inputs,), (targets,)  # the profiler takes the batch's tensors in order
    local = batch // MICROBATCHES
    one_device = rank_activation_bytes(captured, "none", inputs, targets)
    if plan is None:
        per_rank = rank_activation_bytes(captured, variant, inputs, targets)
    else:  # the profiler measures the automatic cut; this row's plan keeps the head whole
        per_rank = _planned_rank_bytes(captured, plan, tp, inputs, targets)
    est = estimate_memory(program, activation_bytes={s: int(b * local) for s, b in per_rank.items()})[0]
    est_one = estimate_memory(program, activation_bytes={s: int(b * local) for s, b in one_device.items()})[0]
    est_ir = estimate_memory(program)[0]
    priced = sharded_collectives(program, Link(bandwidth=1.0))
    modelled = sum(priced.get(ins.segment, {}).get(ins.phase.value, 0.0)
                   for ins in program.plan(0).instructions if ins.segment is not None and ins.phase is not None)
    m0 = next(m for m in measured if m.rank == 0)
    return {"act": m0.activations, "params": m0.parameters, "est": est.peak_activation_bytes,
            "est_one": est_one.peak_activation_bytes, "est_ir": est_ir.peak_activation_bytes,
            "est_params": est.param_bytes, "sent": counter.sent / program.world_size, "priced": modelled}


def _planned_rank_bytes(captured, plan, tp, inputs, targets):
    """``rank_activation_bytes`` for a Shard with ``plan`` (the profiler's own cut is automatic)."""
    from piper_train.tuning import profiler

    original = profiler.one_stage

    def planned(variant, microbatches, regions):
        return parallelize(build_schedule("1f1b", 1, microbatches, stages=regions), tp=tp, tp_plan=plan)

    profiler.one_stage = planned
    try:
        return profiler.rank_activation_bytes(captured, f"tp{tp}", inputs, targets)
    finally:
        profiler.one_stage = original


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = [(c[0], run(c, args.seq, args.batch)) for c in CONFIGS]
    base = rows[0][1]["act"]
    kib = 1024
    print(f"examples/llama dim 64, 4 layers, batch {args.batch} x {args.seq} tokens, float32, 1 stage, "
          f"{MICROBATCHES} microbatches; rank 0\n")
    print("| configuration | activations measured (KiB) | / one device | estimate, rank profile (KiB) | "
          "estimate / measured | with one device's profile / measured | IR-only / measured | parameters measured "
          "(KiB) | estimate / measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['act'] / kib:.0f} | {r['act'] / base:.2f} | {r['est'] / kib:.0f} | "
              f"{r['est'] / r['act']:.2f} | {r['est_one'] / r['act']:.2f} | {r['est_ir'] / r['act']:.2f} | "
              f"{r['params'] / kib:.1f} | {r['est_params'] / r['params']:.2f} |")
    print("\n| configuration | sent per rank per step, measured (KiB) | priced (sharded_collectives) (KiB) | "
          "priced / measured |")
    print("|---|---|---|---|")
    for label, r in rows[1:]:
        ratio = f"{r['priced'] / r['sent']:.2f}" if r["sent"] else "-"
        print(f"| {label} | {r['sent'] / kib:.0f} | {r['priced'] / kib:.0f} | {ratio} |")
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
