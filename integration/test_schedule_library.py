"""Interleaved 1F1B, ZB1P and DualPipeV on the Ray runtime (gloo, CPU) against one device.

Each schedule runs with 2 and 4 pipeline ranks; the oracle is ``piper_train.check.run_check``:
every microbatch loss and every gradient in each of 3 steps, then every parameter, within
rtol 1e-5 / atol 1e-6 in fp32. ZB1P splits every backward into BI/BW; DualPipeV mixes fused
and split backwards and overlapped F&B slots, with the loss on rank 0 (the V's bottom).
"""

from __future__ import annotations

import pytest

from piper_directives import build_schedule
from piper_ir import NodeKind, Phase
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import build_model

pytestmark = pytest.mark.usefixtures("ray_cluster")
SGD = OptimizerSpec("sgd", 0.05, {"momentum": 0.9})


@pytest.mark.parametrize(
    ("schedule", "pp", "microbatches", "stages"),
    [
        ("interleaved_1f1b", 2, 4, 4),
        ("interleaved_1f1b", 4, 8, 8),
        ("zb1p", 2, 8, 2),
        ("zb1p", 4, 4, 4),
        ("dualpipev", 2, 4, 4),
        ("dualpipev", 4, 8, 8),
    ],
)
def test_schedule_matches_single_device(schedule, pp, microbatches, stages):
    workload = build_model("mlp", stages=stages, seed=pp * 10 + microbatches)
    report = run_check(workload, build_schedule(schedule, pp, microbatches, stages=stages), optimizer=SGD)
    assert report.ok, report.failures()
    program = report.program
    assert len(program.ranks) == pp and program.microbatches == microbatches
    computes = [ins for plan in program.ranks for ins in plan.instructions if ins.kind is NodeKind.COMPUTE]
    split = {ins.phase for ins in computes} >= {Phase.BI, Phase.BW}
    assert split == (schedule != "interleaved_1f1b")
    fused = {ins.segment for ins in computes if ins.phase is Phase.B}
    if schedule == "zb1p":
        assert fused == {"loss"}  # every stage's backward is split; the loss has no weights
    params = 2 * stages + 2  # weight and bias of one Linear per region, plus the output Linear
    assert len(report.differences) == 3 * (microbatches + params) + params  # every loss, grad, param
