"""DualPipe on the Ray runtime (gloo, CPU) against one device.

DualPipe places each stage's microbatches by direction (the first half on rank s, the second
on rank ``pp - 1 - s``), so every stage has two mirrored replicas whose gradients are summed
by an all-reduce over the pair before both take the same optimizer step; the batch is not
sharded among them and the loss is scaled by ``1 / microbatches`` only. The oracle is
``piper_train.check.run_check``: every microbatch loss and every gradient in each of 3 steps,
then every parameter, within rtol 1e-5 / atol 1e-6 in fp32.

With data parallelism and ZeRO-2/3 each direction shards a stage over its own replicas and
the mirror ranks sum their gradient shards before the step; those cases run fp64 AdamW
within rtol 1e-9 / atol 1e-12, as integration/test_data_parallel.py does (PP=2 x DP=2 at
ZeRO 2 and 3, PP=4 x DP=2, 8 ranks, at ZeRO 3 only: about 30 s).
"""

from __future__ import annotations

import pytest
import torch

from piper_directives import build_schedule
from piper_ir import NodeKind, Phase
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import build_model

pytestmark = pytest.mark.usefixtures("ray_cluster")
SGD = OptimizerSpec("sgd", 0.05, {"momentum": 0.9})
ADAMW = OptimizerSpec("adamw", 1e-3)


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_dualpipe_matches_single_device(pp, microbatches):
    workload = build_model("mlp", stages=pp, seed=pp * 10 + microbatches)
    report = run_check(workload, build_schedule("dualpipe", pp, microbatches), optimizer=SGD)
    assert report.ok, report.failures()
    program = report.program
    assert len(program.ranks) == pp and program.microbatches == microbatches
    assert program.replicas == 1 and all(plan.replica == 0 for plan in program.ranks)  # no batch shards
    for s in range(pp):
        assert program.devices_of(f"s{s}") == tuple(sorted({s, pp - 1 - s}))  # the mirror pair
    half = microbatches // 2
    for plan in program.ranks:
        r = plan.rank
        computes = [i for i in plan.instructions if i.kind is NodeKind.COMPUTE and i.segment != "loss"]
        # Rank r runs stage r for the first half of the microbatches, stage pp-1-r for the second.
        assert {(i.segment, i.microbatch < half) for i in computes} == {(f"s{r}", True), (f"s{pp - 1 - r}", False)}
        assert {i.phase for i in computes} >= {Phase.F, Phase.BI, Phase.BW}
        reductions = [i for i in plan.instructions if i.kind is NodeKind.ALL_REDUCE]
        assert sorted(i.value.split(":")[1] for i in reductions) == sorted({f"s{r}", f"s{pp - 1 - r}"})
    params = 2 * pp + 2  # weight and bias of one Linear per region, plus the output Linear
    assert len(report.differences) == 3 * (microbatches + params) + params  # every loss, grad, param


def test_dualpipe_with_two_regions_per_stage():
    workload = build_model("mlp", stages=4, seed=7)
    report = run_check(workload, build_schedule("dualpipe", 2, 4, stages=4), optimizer=SGD)
    assert report.ok, report.failures()


@pytest.mark.parametrize("zero", [0, 1])
def test_dualpipe_with_data_parallel(zero):
    """dp=2: each mirror pair times the data-parallel pair is one group of four replicas that
    sum their gradients; the batch is sharded over the data-parallel pair only."""
    workload = build_model("mlp", stages=2, seed=3 + zero)
    report = run_check(workload, build_schedule("dualpipe", 2, 4, dp=2, zero=zero), optimizer=SGD)
    assert report.ok, report.failures()
    program = report.program
    assert program.replicas == 2 and [plan.replica for plan in program.ranks] == [0, 0, 1, 1]
    assert {r.devices for r in program.replication} == {(0, 1, 2, 3)}


@pytest.mark.parametrize(("pp", "zero"), [(2, 2), (2, 3), (4, 3)])
def test_dualpipe_with_zero_sharded_per_direction(pp, zero):
    """dp=2, ZeRO-2/3: each direction shards a stage over its own two data-parallel ranks
    (per-microbatch reduce-scatters and parameter gathers stay inside the direction); the two
    mirror ranks holding one shard range sum its gradient, then both step it. fp64 AdamW, as
    in test_data_parallel, so the comparison is tight and the optimizer state is sharded."""
    microbatches = 2 * pp
    workload = build_model("mlp", stages=pp, seed=11 * pp + zero, dtype=torch.float64)
    strategy = build_schedule("dualpipe", pp, microbatches, dp=2, zero=zero)
    report = run_check(workload, strategy, optimizer=ADAMW, rtol=1e-9, atol=1e-12)
    assert report.ok, report.failures()
    program = report.program
    assert program.replicas == 2 and [plan.replica for plan in program.ranks] == [r // pp for r in range(2 * pp)]
    for s in range(pp):
        forward, backward = (s, s + pp), (pp - 1 - s, 2 * pp - 1 - s)
        assert {(b.devices, b.shards) for b in program.buckets if b.segment == f"s{s}"} == {(forward, 2), (backward, 2)}
    for plan in program.ranks:
        group = {r for r in range(2 * pp) if r % pp == plan.rank % pp}  # its direction's replicas
        mirror = {plan.rank, plan.rank - plan.rank % pp + pp - 1 - plan.rank % pp}
        for ins in plan.instructions:
            comm = next((c for c in program.communicators if c.id == ins.communicator), None)
            if ins.kind in (NodeKind.REDUCE_SCATTER, NodeKind.ALL_GATHER, NodeKind.MATERIALIZE):
                assert set(comm.ranks) == group, ins.id
            elif ins.kind is NodeKind.ALL_REDUCE:  # the mirror sum of a gradient shard
                assert set(comm.ranks) == mirror, ins.id
        kinds = {ins.kind for ins in plan.instructions}
        assert NodeKind.ALL_REDUCE in kinds and (NodeKind.MATERIALIZE in kinds) == (zero == 3)
    params = 2 * pp + 2
    assert len(report.differences) == 3 * (microbatches + params) + params
