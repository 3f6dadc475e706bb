"""Data parallelism and ZeRO 0-3 on the Ray runtime (gloo, CPU) against one device.

Each case replicates a library schedule twice (``build_schedule(..., dp=2, zero=k)``: pipeline
rank r, replica j on device ``r + j * pp``), plans memory and trains 3 steps with AdamW, so
optimizer-state sharding is exercised. The oracle is ``piper_train.check.run_check``: every
microbatch loss (the mean over replicas of their shard losses), every gradient (gathered to
full) in each step, and every parameter (gathered to full) after the last, within rtol 1e-9 /
atol 1e-12. The models run in float64: the replicas' gradient is a sum of shard gradients,
which rounds differently from one device's, and AdamW divides each element's step by that
element's own gradient RMS, so in fp32 an element whose gradient is ~0 moves by up to ``lr``
on rounding noise alone. fp64 removes the noise instead of loosening the comparison.

DP=2 alone runs GPipe and ZB1P with both regions on one pipeline rank (so ZeRO-3 chains break
between the regions), every zero level; PP=2 x DP=2 runs 1F1B, interleaved 1F1B and
DualPipeV at every zero level. Left out to save time: 1F1B with pp=1 (with one rank it
orders compute like GPipe).
"""

from __future__ import annotations

import pytest
import torch

from piper_directives import build_schedule
from piper_ir import NodeKind
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import build_model

pytestmark = pytest.mark.usefixtures("ray_cluster")
ADAMW = OptimizerSpec("adamw", 1e-3)
RTOL, ATOL = 1e-9, 1e-12
EXPECTED = {
    0: {NodeKind.ALL_REDUCE},
    1: {NodeKind.REDUCE_SCATTER, NodeKind.ALL_GATHER},
    2: {NodeKind.REDUCE_SCATTER, NodeKind.ALL_GATHER},
    3: {NodeKind.REDUCE_SCATTER, NodeKind.MATERIALIZE, NodeKind.FREE},
}


CASES = [
    *(("gpipe", 1, 2, 2, zero) for zero in (0, 1, 2, 3)),
    *(("zb1p", 1, 2, 2, zero) for zero in (0, 1, 2, 3)),
    *(("1f1b", 2, 4, 2, zero) for zero in (0, 1, 2, 3)),
    *(("interleaved_1f1b", 2, 4, 4, zero) for zero in (0, 1, 2, 3)),
    *(("dualpipev", 2, 4, 4, zero) for zero in (0, 1, 2, 3)),
]


@pytest.mark.parametrize(("schedule", "pp", "microbatches", "stages", "zero"), CASES)
def test_dp2_matches_single_device(schedule, pp, microbatches, stages, zero):
    workload = build_model("mlp", stages=stages, seed=7 * pp + zero, dtype=torch.float64)
    strategy = build_schedule(schedule, pp, microbatches, stages=stages, dp=2, zero=zero)
    report = run_check(workload, strategy, optimizer=ADAMW, rtol=RTOL, atol=ATOL)
    assert report.ok, report.failures()
    program = report.program
    assert (program.world_size, program.replicas) == (2 * pp, 2)
    assert [p.replica for p in program.ranks] == [r // pp for r in range(2 * pp)]
    kinds = {ins.kind for plan in program.ranks for ins in plan.instructions}
    assert kinds & {k for s in EXPECTED.values() for k in s} == EXPECTED[zero]
    params = 2 * stages + 2  # weight and bias of one Linear per region, plus the output Linear
    assert len(report.differences) == 3 * (microbatches + params) + params  # every loss, grad, param
