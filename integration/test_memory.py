"""Measured per-rank memory against the static estimate and against ZeRO theory.

PP=2 x DP=2, 1F1B over 4 microbatches, the tiny transformer (one segment per pipeline rank,
cut into buckets of at most 70 KiB: 4 per segment), AdamW, one step at each ZeRO level. For
every rank the runtime's ``RankMemory`` (peak bytes per category over the step) must agree
with ``piper_memory.estimate_memory`` within 10% in each model-state category (parameters,
gradients, optimizer state) and in communication, and the measured model state must be within
10% of the theory for N = 2 replicas, P = the rank's parameter bytes, B = its largest bucket:

| zero | parameters | gradients | optimizer state (AdamW: 2P) |
| --- | --- | --- | --- |
| 0 | P | P | 2P |
| 1 | P | P | 2P/N |
| 2 | P | P/N + B | 2P/N |
| 3 | P/N (+ one gathered bucket, counted as communication) | P/N + B | 2P/N |

B is the one bucket whose full gradients exist at a time: from ZeRO-2 on the runtime
reduce-scatters each bucket during the backward as soon as its gradients are complete
(``piper_runtime.rank.buckets``), so a segment's full gradients never exist all at once. The
runtime counts ZeRO-3's gathered parameters as communication; the plan gathers a segment's
buckets together for each chain of uses, so ZeRO-3's communication peak exceeds ZeRO-2's
(same order, same buffers otherwise) by one segment's gathered buckets. Activations are printed, not asserted: without a profile the
estimate counts only segment outputs (benchmarks/bench_memory.py passes a profile).
"""

from __future__ import annotations

import pytest

from piper_directives import build_schedule, capture, data_parallel
from piper_ir import Program, SegmentRole
from piper_memory import estimate_memory, plan_memory
from piper_runtime import OptimizerSpec, Runtime
from piper_scheduler import compile_program
from piper_train.models import build_model

pytestmark = pytest.mark.usefixtures("ray_cluster")
N = 2
TOLERANCE = 0.10
BUCKET_MB = 70 / 1024
MEASURED: dict[int, tuple] = {}  # zero -> (program, RankMemory per rank), for the ZeRO-3 check


def _run(zero: int):
    spec = build_model("transformer", stages=2, seed=3)
    captured = capture(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn)
    strategy = data_parallel(build_schedule("1f1b", 2, 4, stages=2), N, zero, bucket_mb=BUCKET_MB)
    program = compile_program(plan_memory(strategy.apply(captured.graph)))
    runtime = Runtime(program, captured.modules, OptimizerSpec("adamw", 1e-3))
    try:
        memory = runtime.step(*spec.batches(0), memory=True).memory
    finally:
        runtime.shutdown()
    return program, memory


def _theory(program: Program, rank: int, zero: int) -> int:
    """Parameters + gradients + optimizer state of ``rank`` by the table above."""
    stages = [
        program.segment_by_id[s]
        for s in program.plan(rank).segments()
        if program.segment_by_id[s].role is SegmentRole.STAGE
    ]
    p = sum(meta.nbytes() for seg in stages for _, meta in seg.params)
    ids = {seg.id for seg in stages}
    bucket = max(b.numel * 4 for b in program.buckets if b.segment in ids)  # float32
    return {
        0: p + p + 2 * p,
        1: p + p + 2 * p // N,
        2: p + (p // N + bucket) + 2 * p // N,
        3: p // N + (p // N + bucket) + 2 * p // N,
    }[zero]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_measured_memory_matches_estimate_and_theory(zero: int) -> None:
    program, memory = _run(zero)
    MEASURED[zero] = (program, memory)
    estimates = estimate_memory(program, "adamw")
    assert len(memory) == program.world_size == 4
    lines, bad = [], []
    for m in memory:
        est = estimates[m.rank].categories()
        theory = _theory(program, m.rank, zero)
        lines.append(
            f"zero {zero} rank {m.rank}: model state {m.model_state} (estimate "
            f"{est['parameters'] + est['gradients'] + est['optimizer_state']}, theory {theory}); "
            f"communication {m.communication} (estimate {est['communication']}); "
            f"activations {m.activations} (estimate, outputs only, {est['activations']})"
        )
        for what in ("parameters", "gradients", "optimizer_state", "communication"):
            if abs(getattr(m, what) - est[what]) > TOLERANCE * est[what]:
                bad.append(f"rank {m.rank} {what}: measured {getattr(m, what)}, estimated {est[what]}")
        if abs(m.model_state - theory) > TOLERANCE * theory:
            bad.append(f"rank {m.rank} model state: measured {m.model_state}, theory {theory}")
    print("\n".join(lines))
    assert not bad, "\n".join(bad)


def test_zero3_holds_one_gathered_segment() -> None:
    """A chain of uses gathers all buckets of its segment (``MATERIALIZE`` per bucket, before
    the chain): ZeRO-3 holds one segment's gathered parameters on top of ZeRO-2's buffers."""
    if not {2, 3} <= set(MEASURED):
        pytest.skip("needs the zero 2 and 3 runs of this file")
    program, zero3 = MEASURED[3]
    _, zero2 = MEASURED[2]
    per_segment: dict[str, int] = {}
    for b in program.buckets:
        per_segment[b.segment] = per_segment.get(b.segment, 0) + b.padded_numel * 4  # float32
    largest: dict[int, int] = {}
    for seg, nbytes in per_segment.items():
        for rank in program.devices_of(seg):
            largest[rank] = max(largest.get(rank, 0), nbytes)
    for m3, m2 in zip(zero3, zero2, strict=True):
        extra = m3.communication - m2.communication
        assert abs(extra - largest[m3.rank]) <= TOLERANCE * largest[m3.rank], (
            m3.rank,
            extra,
            largest[m3.rank],
        )
        assert m3.parameters < 0.6 * m2.parameters  # only the shard lasts
