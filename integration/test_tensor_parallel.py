"""Tensor parallelism (``Shard``) on the Ray runtime (gloo, CPU) against one device.

The tiny transformer (d 64, 4 heads, MLP hidden 256) runs with TP=2 alone and composed with
PP=2 under 1F1B (``tensor_parallel(one_f_one_b(...), 2)``: stage r on devices 2r, 2r+1). Its
attention heads and MLP hidden units are split across each TP group (column-/row-parallel
Linear pairs with Megatron's f/g all-reduces inside the segment code). The oracle is
``piper_train.check.run_check`` over 3 AdamW steps: every microbatch loss, every gradient
(sharded ones gathered to full weights) and every parameter after the last step. fp64, for
the reason test_data_parallel.py gives: a row-parallel Linear's output is a sum of partial
products over ranks, which rounds differently from one device's matmul, and AdamW turns
rounding noise in near-zero gradients into visible updates.
"""

from __future__ import annotations

import pytest
import torch

from piper_directives import Place, Shard, Split, Strategy, one_f_one_b, tensor_parallel
from piper_ir import NodeKind
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import build_model

pytestmark = pytest.mark.usefixtures("ray_cluster")
ADAMW = OptimizerSpec("adamw", 1e-3)
RTOL, ATOL = 1e-9, 1e-12


def _tp_compute(program):
    return [
        ins for plan in program.ranks for ins in plan.instructions
        if ins.kind is NodeKind.COMPUTE and ins.communicator is not None
    ]


def test_tp2_matches_single_device():
    workload = build_model("transformer", stages=1, seed=3, dtype=torch.float64)
    strategy = Strategy([Split(2), Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1))])
    report = run_check(workload, strategy, optimizer=ADAMW, rtol=RTOL, atol=ATOL)
    assert report.ok, report.failures()
    program = report.program
    assert (program.world_size, program.replicas) == (2, 1)
    assert [c.id for c in program.communicators] == ["tp:0-1"]
    assert {ins.communicator for ins in _tp_compute(program)} == {"tp:0-1"}
    sharded = {p.name for sh in program.sharding for p in sh.params}
    assert "blocks.0.attn.qkv.weight" in sharded and "blocks.0.mlp.2.weight" in sharded


def test_pp2_tp2_1f1b_matches_single_device():
    workload = build_model("transformer", stages=2, seed=5, dtype=torch.float64)
    strategy = tensor_parallel(one_f_one_b(2, 4), 2)
    report = run_check(workload, strategy, optimizer=ADAMW, rtol=RTOL, atol=ATOL)
    assert report.ok, report.failures()
    program = report.program
    assert (program.world_size, program.replicas) == (4, 1)
    assert {c.id for c in program.communicators} >= {"tp:0-1", "tp:2-3", "pp.fwd", "pp.bwd"}
    sends = [ins for plan in program.ranks for ins in plan.instructions if ins.kind is NodeKind.SEND]
    assert {(plan.rank, ins.peer) for plan in program.ranks for ins in plan.instructions
            if ins.kind is NodeKind.SEND and not ins.value.startswith("grad:")} == {(0, 2), (1, 3)}
    assert sends
