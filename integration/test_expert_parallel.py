"""Expert parallelism (``Shard(kind="ep")``) on the Ray runtime (gloo, CPU) against one device.

The MoE model (``build_model("moe")``: per region a projection and a residual MoE layer with
a top-2 softmax router over 4 experts and a shared expert) runs with EP=2 (each rank a
data-parallel replica of the router, projections and shared expert, holding 2 of the 4
experts; tokens dispatched and combined with uneven all-to-alls) and composed with PP=2
under 1F1B and DualPipeV, with EP=4 (one expert per rank) and with ZeRO-1 on the
non-expert weights. The oracle is ``piper_train.check.run_check`` over 3 AdamW steps in fp64: every
microbatch loss, every gradient (expert gradients gathered to full stacked weights) and
every parameter after the last step. The routing of the test data is checked to be uneven,
so the all-to-alls really move different amounts per rank.
"""

from __future__ import annotations

import pytest
import torch

from piper_directives import Place, Replicate, Shard, Split, Strategy, dualpipev, expert_parallel, one_f_one_b
from piper_ir import NodeKind
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import build_model
from piper_train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("ray_cluster")
ADAMW = OptimizerSpec("adamw", 1e-3)
RTOL, ATOL = 1e-9, 1e-12


def test_ep2_matches_single_device(assert_uneven):
    workload = build_model("moe", stages=1, seed=3, dtype=torch.float64)
    assert_uneven(workload)
    strategy = Strategy([Split(2), Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1), kind="ep")])
    report = run_check(workload, strategy, optimizer=ADAMW, rtol=RTOL, atol=ATOL)
    assert report.ok, report.failures()
    program = report.program
    assert (program.world_size, program.replicas) == (2, 2)
    assert [p.replica for p in program.ranks] == [0, 1]
    assert {c.id: c.traffic for c in program.communicators} == {"dp:0-1": "dp", "ep:0-1": "ep"}
    experts = {p.name for sh in program.sharding for p in sh.params}
    assert experts == {"blocks.0.moe.experts.w1", "blocks.0.moe.experts.b1", "blocks.0.moe.experts.w2"}
    bucketed = {n for b in program.buckets for n in b.params}
    assert not experts & bucketed and "blocks.0.moe.router.weight" in bucketed
    compute = [i for plan in program.ranks for i in plan.instructions if i.kind is NodeKind.COMPUTE and i.communicator]
    assert {i.communicator for i in compute} == {"ep:0-1"}


def test_pp2_ep2_1f1b_matches_single_device(assert_uneven):
    workload = build_model("moe", stages=2, seed=5, dtype=torch.float64)
    assert_uneven(workload)
    report = run_check(workload, expert_parallel(one_f_one_b(2, 4), 2), optimizer=ADAMW, rtol=RTOL, atol=ATOL)
    assert report.ok, report.failures()
    program = report.program
    assert (program.world_size, program.replicas) == (4, 2)
    assert {c.id for c in program.communicators} >= {"ep:0-1", "ep:2-3", "dp:0-1", "dp:2-3", "pp.fwd", "pp.bwd"}


def test_ep2_with_zero1_on_non_expert_weights_matches_single_device(assert_uneven):
    workload = build_model("moe", stages=1, seed=4, dtype=torch.float64)
    assert_uneven(workload)
    strategy = Strategy([
        Split(2), Place({"PP": 0}, (0, 1)), Replicate({"PP": 0}, (0, 1), zero=1), Shard({"PP": 0}, (0, 1), kind="ep"),
    ])
    report = run_check(workload, strategy, optimizer=ADAMW, rtol=RTOL, atol=ATOL)
    assert report.ok, report.failures()
    program = report.program
    assert {(r.segment, r.zero) for r in program.replication} >= {("s0", 1)}
    assert all(b.shards == 2 for b in program.buckets)
    assert not {p.name for sh in program.sharding for p in sh.params} & {n for b in program.buckets for n in b.params}


def test_ep4_one_expert_per_rank_matches_single_device(assert_uneven):
    workload = build_model("moe", stages=1, seed=3, dtype=torch.float64)
    assert_uneven(workload)  # with one expert per rank, uneven per-expert counts = uneven splits
    devices = (0, 1, 2, 3)
    strategy = Strategy([Split(2), Place({"PP": 0}, devices), Shard({"PP": 0}, devices, kind="ep")])
    report = run_check(workload, strategy, optimizer=ADAMW, rtol=RTOL, atol=ATOL)
    assert report.ok, report.failures()
    assert (report.program.world_size, report.program.replicas) == (4, 4)


def test_pp2_ep2_dualpipev_matches_single_device(assert_uneven):
    workload = build_model("moe", stages=4, seed=5, dtype=torch.float64)
    assert_uneven(workload)
    report = run_check(workload, expert_parallel(dualpipev(2, 4), 2), optimizer=ADAMW, rtol=RTOL, atol=ATOL)
    assert report.ok, report.failures()
    assert {c.id for c in report.program.communicators} >= {"ep:0-1", "ep:2-3"}


def test_dualpipev_runs_paired_chunks_side_by_side():
    """In a profiled DualPipeV step with EP the forward and backward chunk of an overlapped
    slot run at the same time (two threads), not one after the other."""
    workload = build_model("moe", stages=4, seed=5)
    with Trainer(
        workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
        expert_parallel(dualpipev(2, 4), 2), optimizer=OptimizerSpec("sgd", 0.01),
    ) as trainer:
        result = trainer.runtime.step(*workload.batches(0), profile=True)
        program = trainer.program
    spans = {(t.rank, t.instruction): (t.start, t.end) for t in result.timings}
    sides: dict[tuple[int, int], dict[int, list[tuple[float, float]]]] = {}
    for plan in program.ranks:
        for ins in plan.instructions:
            if ins.overlap is not None:
                slot = sides.setdefault((plan.rank, ins.overlap), {})
                slot.setdefault(ins.microbatch, []).append(spans[(plan.rank, ins.id)])
    assert sides and all(len(slot) == 2 for slot in sides.values())  # a forward and a backward chunk
    overlapping = 0
    for slot in sides.values():
        (a0, a1), (b0, b1) = ((min(s for s, _ in v), max(e for _, e in v)) for v in slot.values())
        overlapping += a0 < b1 and b0 < a1
    assert overlapping >= len(sides) // 2, (overlapping, len(sides))
