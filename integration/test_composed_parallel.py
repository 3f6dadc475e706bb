"""Tensor and expert parallelism composed with data parallelism, on the Ray runtime (gloo,
CPU), against one device.

- DP=2 x TP=2 (``tensor_parallel(one_f_one_b(1, 2, dp=2, zero=k), 2)``: devices 0-1 are one
  tensor-parallel group, 2-3 the other; the ranks holding the same shard, (0, 2) and (1, 3),
  reduce its gradients; the batch is cut in two, each TP group sees one half).
- DP=2 x EP=2 (``expert_parallel(one_f_one_b(1, 2, dp=2, zero=k), 2)``: the MoE model's
  experts split over (0, 1) and over (2, 3), each expert block held by two ranks, (0, 2) and
  (1, 3), that reduce its gradients; the router, projections and shared expert are
  data-parallel over all four ranks; the batch is cut in four).

The oracle is ``piper_train.check.run_check`` over 3 AdamW steps in fp64 at rtol 1e-9 (see
test_tensor_parallel.py and test_expert_parallel.py for why): every microbatch loss, every
gradient (shards and ZeRO shards gathered to full tensors) and every parameter after the
last step.
"""

from __future__ import annotations

import pytest
import torch

from piper_directives import expert_parallel, one_f_one_b, tensor_parallel
from piper_ir import NodeKind
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import build_model

pytestmark = pytest.mark.usefixtures("ray_cluster")
ADAMW = OptimizerSpec("adamw", 1e-3)
RTOL, ATOL = 1e-9, 1e-12


def _collectives(program, kind):
    return {(plan.rank, ins.communicator) for plan in program.ranks for ins in plan.instructions if ins.kind is kind}


@pytest.mark.parametrize("zero", [0, 1])
def test_dp2_tp2_matches_single_device(zero):
    workload = build_model("transformer", stages=1, seed=3, dtype=torch.float64)
    report = run_check(
        workload, tensor_parallel(one_f_one_b(1, 2, dp=2, zero=zero), 2), optimizer=ADAMW, rtol=RTOL, atol=ATOL
    )
    assert report.ok, report.failures()
    program = report.program
    assert (program.world_size, program.replicas) == (4, 2)
    assert [p.replica for p in program.ranks] == [0, 0, 1, 1]
    assert {c.id for c in program.communicators} == {"tp:0-1", "tp:2-3", "dp:0-2", "dp:1-3"}
    reduce = NodeKind.ALL_REDUCE if zero == 0 else NodeKind.REDUCE_SCATTER
    assert _collectives(program, reduce) == {(0, "dp:0-2"), (2, "dp:0-2"), (1, "dp:1-3"), (3, "dp:1-3")}


@pytest.mark.parametrize("zero", [0, 2])
def test_dp2_ep2_matches_single_device(zero, assert_uneven):
    workload = build_model("moe", stages=1, seed=3, dtype=torch.float64)
    assert_uneven(workload)
    report = run_check(
        workload, expert_parallel(one_f_one_b(1, 2, dp=2, zero=zero), 2), optimizer=ADAMW, rtol=RTOL, atol=ATOL
    )
    assert report.ok, report.failures()
    program = report.program
    assert (program.world_size, program.replicas) == (4, 4)
    assert {c.id for c in program.communicators} == {"ep:0-1", "ep:2-3", "dp:0-1-2-3", "dp:0-2", "dp:1-3"}
    experts = {p.name for sh in program.sharding for p in sh.params}
    by_group = {b.devices: set(b.params) for b in program.buckets}
    assert by_group[(0, 2)] == by_group[(1, 3)] == experts
    assert not by_group[()] & experts and "blocks.0.moe.router.weight" in by_group[()]
