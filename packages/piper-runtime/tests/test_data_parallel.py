"""Data parallelism and ZeRO 0-3 on the runtime against single-device training.

The Programs are built by hand, following docs/ir-conventions.md section 7 (what
``Replicate`` + ``piper_memory.plan_memory`` + ``compile`` emit): one Linear segment ``s0``
and the MSE loss, both replicated over ranks (0, 1), 2 microbatches, AdamW. The Linear's
weight (15 elements) and bias (5) are two buckets, so both are padded when sharded over 2;
each bucket says where its state lives (``piper_memory.zero_residency``, as ``plan_memory``
fills it), which is all the runtime reads. Each level's plan, per rank (replica r = rank r):

- zero 0: F/B of both microbatches, then ``allreduce`` of each bucket, then ``OPT``;
- zero 1: ... ``reducescatter`` of each bucket once, ``OPT`` (on shards), ``allgather``;
- zero 2: a ``reducescatter.<b>.mb<i>`` after each microbatch's backward, ``OPT``, ``allgather``;
- zero 3: as 2, plus ``materialize`` before and ``free`` after each F..B chain (microbatch 0
  frees before reduce-scattering, microbatch 1 after: both orders are legal), no allgather.
"""

from __future__ import annotations

import sys

import attrs
import pytest
import torch
from ray import cloudpickle
from torch import nn

from piper_ir import (
    Bucket,
    Communicator,
    ExecutionError,
    Instruction,
    NodeKind,
    Phase,
    Program,
    RankPlan,
    Replication,
    Segment,
    SegmentRole,
    Tags,
    Value,
)
from piper_memory import zero_residency
from piper_runtime import OptimizerSpec, Runtime
from piper_runtime.rank.memory import RankMemory
from piper_runtime.rank.worker import RankWorker
from piper_runtime.testing import MSE, compute, tensor_meta, with_stream_events

cloudpickle.register_pickle_by_value(sys.modules[__name__])

M, N, BATCH, D_IN, D_OUT = 2, 2, 8, 3, 5
SHARD = BATCH // (M * N)
DP = "dp:0-1"
BUCKETS = ("bucket:s0:0", "bucket:s0:1")


class Stage(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.l0 = lin

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.l0(x),)


def _coll(kind: NodeKind, name: str, bucket: str, mb: int | None = None, k: int | None = None) -> Instruction:
    ident = f"{name}.{bucket}" + ("" if mb is None else f".mb{mb}") + ("" if k is None else f".{k}")
    return Instruction(ident, kind, stream="dp", segment="s0", microbatch=mb, value=bucket, communicator=DP)


def _rs(mb: int | None = None) -> list[Instruction]:
    return [_coll(NodeKind.REDUCE_SCATTER, "reducescatter", b, mb) for b in BUCKETS]


def _mat(k: int) -> list[Instruction]:
    return [_coll(NodeKind.MATERIALIZE, "materialize", b, k=k) for b in BUCKETS]


def _free(k: int) -> list[Instruction]:
    return [_coll(NodeKind.FREE, "free", b, k=k) for b in BUCKETS]


def _fb(mb: int) -> list[Instruction]:
    return [compute("s0", Phase.F, mb), compute("loss", Phase.F, mb), compute("loss", Phase.B, mb), compute("s0", Phase.B, mb)]


def dp_plan(zero: int) -> list[Instruction]:
    gather = [_coll(NodeKind.ALL_GATHER, "allgather", b) for b in BUCKETS]
    opt = [compute("s0", Phase.OPT)]
    if zero == 0:
        return _fb(0) + _fb(1) + [_coll(NodeKind.ALL_REDUCE, "allreduce", b) for b in BUCKETS] + opt
    if zero == 1:
        return _fb(0) + _fb(1) + _rs() + opt + gather
    if zero == 2:
        return _fb(0) + _rs(0) + _fb(1) + _rs(1) + opt + gather
    return _mat(0) + _fb(0) + _free(0) + _rs(0) + _mat(1) + _fb(1) + _rs(1) + _free(1) + opt


def dp_program(zero: int) -> Program:
    values = (
        Value("input:0", tensor_meta(SHARD, D_IN, grad=False)),
        Value("target:0", tensor_meta(SHARD, D_OUT, grad=False)),
        Value("v:y", tensor_meta(SHARD, D_OUT)),
        Value("v:loss", tensor_meta(batch_dim=None)),
        Value("grad:v:y", tensor_meta(SHARD, D_OUT)),
    )
    params = (("l0.weight", tensor_meta(D_OUT, D_IN, batch_dim=None)), ("l0.bias", tensor_meta(D_OUT, batch_dim=None)))
    segments = (
        Segment("s0", SegmentRole.STAGE, Tags.of(), ("input:0",), ("v:y",), params),
        Segment("loss", SegmentRole.LOSS, Tags.of(), ("v:y", "target:0"), ("v:loss",)),
    )
    shards = N if zero >= 1 else 1
    buckets = (
        Bucket(BUCKETS[0], "s0", ("l0.weight",), D_OUT * D_IN, shards, **zero_residency(zero)),
        Bucket(BUCKETS[1], "s0", ("l0.bias",), D_OUT, shards, **zero_residency(zero)),
    )
    return Program(
        world_size=N,
        ranks=tuple(RankPlan(r, with_stream_events(dp_plan(zero)), replica=r) for r in range(N)),
        communicators=(Communicator(DP, (0, 1), "dp"),),
        segments=segments,
        values=values,
        inputs=("input:0",),
        targets=("target:0",),
        microbatches=M,
        placement=(("s0", (0, 1)), ("loss", (0, 1))),
        replicas=N,
        replication=(Replication("s0", (0, 1), zero=zero),),
        buckets=buckets,
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_matches_single_device(ray_cluster, zero: int) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(D_IN, D_OUT)
    ref = nn.ModuleDict({"l0": nn.Linear(D_IN, D_OUT)})
    ref.load_state_dict({f"l0.{k}": v for k, v in lin.state_dict().items()})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    spec = OptimizerSpec("adamw", lr=0.05, kwargs={"weight_decay": 0.1})

    with Runtime(dp_program(zero), {"s0": Stage(lin), "loss": MSE()}, spec) as rt:
        for step in range(3):
            x, t = _batch(step)
            result = rt.step((x,), (t,), keep_grads=True, memory=True)
            ref_opt.zero_grad()
            full = nn.functional.mse_loss(ref["l0"](x), t)
            full.backward()
            with torch.no_grad():  # microbatch i = rows [4i, 4i+4), its loss the mean over them
                ref_losses = [
                    nn.functional.mse_loss(ref["l0"](xc), tc).item()
                    for xc, tc in zip(x.chunk(M), t.chunk(M), strict=True)
                ]
            assert result.losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
            assert result.loss == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
            assert set(result.grads) == {"l0.weight", "l0.bias"}
            for name, p in ref.named_parameters():
                _close(result.grads[name], p.grad)
            ref_opt.step()
            assert len(result.memory) == N
            if step > 0:  # optimizer state exists from the end of step 1
                _check_model_state(zero, result.memory)
        params = rt.parameters()
        assert set(params) == {"l0.weight", "l0.bias"}
        for name, p in ref.named_parameters():
            _close(params[name], p.detach())


F32 = 4
PARAM_BYTES = (D_OUT * D_IN + D_OUT) * F32  # 80: weight 15 + bias 5 elements
WEIGHT_BYTES = D_OUT * D_IN * F32  # 60: the larger bucket
SHARD_BYTES = (8 + 3) * F32  # 44: this replica's shards of the padded buckets (16 and 6 elements)
PADDED_BYTES = (16 + 6) * F32  # 88: both buckets gathered in full, padding included
Y_BYTES = SHARD * D_OUT * F32  # 40: one microbatch shard of the Linear's output


def test_zero0_memory_matches_hand_count(ray_cluster) -> None:
    """Per-rank peaks of ZeRO-0, counted by hand from the plan:

    - parameters: the Linear's weight and bias;
    - gradients: their ``.grad``;
    - optimizer state: AdamW's two moments per parameter plus a 4-byte ``step`` tensor for
      each of the 2 parameters (present from the end of step 1);
    - communication: the larger flattened bucket (the weight) during its all-reduce;
    - activations: after the loss's backward of microbatch 1, its output ``v:y`` kept for
      ``B.s0``, the gradient ``grad:v:y`` and the two 4-byte loss values (``v:loss`` of each
      microbatch, never read, kept until the step ends).

    Peak total: step 1 after ``OPT`` (params + state + loss values) = 80 + 168 + 8; from
    step 2 on, after ``B.loss.mb1`` (params + mb0's grads + state + activations).

    That is the plan's count, with each loss backward apart from its stage's
    (``fuse_loss_backward=False``). Run fused (the default, ``piper_runtime.rank.compute``), the
    loss's backward goes through ``s0`` at once: ``grad:v:y`` never exists and ``v:y`` is
    gone when the pass ends, so only the activations' peak changes, and it is lower."""
    torch.manual_seed(0)
    program = dp_program(0)
    modules = {"s0": Stage(nn.Linear(D_IN, D_OUT)), "loss": MSE()}
    state = 2 * PARAM_BYTES + 2 * F32
    acts = 2 * Y_BYTES + M * F32
    unfused = []
    with Runtime(program, modules, OptimizerSpec("adamw"), fuse_loss_backward=False) as rt:
        for step, total in ((0, PARAM_BYTES + state + M * F32), (1, 2 * PARAM_BYTES + state + acts)):
            result = rt.step(*((t,) for t in _batch(step)), memory=True)
            unfused.append(result.memory)
            for rank, mem in enumerate(result.memory):
                assert mem == RankMemory(
                    rank,
                    parameters=PARAM_BYTES,
                    gradients=PARAM_BYTES,
                    optimizer_state=state,
                    communication=D_OUT * D_IN * F32,
                    activations=acts,
                    total=total,
                )
    torch.manual_seed(0)
    modules = {"s0": Stage(nn.Linear(D_IN, D_OUT)), "loss": MSE()}
    with Runtime(program, modules, OptimizerSpec("adamw")) as rt:
        for step in (0, 1):
            for mem, apart in zip(rt.step(*((t,) for t in _batch(step)), memory=True).memory, unfused[step], strict=True):
                assert attrs.evolve(mem, activations=0, total=0) == attrs.evolve(apart, activations=0, total=0)
                assert mem.activations < apart.activations


def _check_model_state(zero: int, memory: tuple[RankMemory, ...]) -> None:
    """Optimizer state is sharded from ZeRO-1 on, gradients between microbatches from ZeRO-2
    on, parameters from ZeRO-3 on, where the gathered buckets count as communication buffers.
    From ZeRO-2 on each bucket is reduce-scattered as soon as the backward completes it (the
    bias first, then the weight), so the full gradients of at most one bucket exist at a
    time: the weight's 15 elements, never both buckets' 20."""
    params, grads, state = {
        0: (PARAM_BYTES, PARAM_BYTES, 2 * PARAM_BYTES),
        1: (PADDED_BYTES, PARAM_BYTES, 2 * SHARD_BYTES),  # the shard is a view of the params
        2: (PADDED_BYTES, WEIGHT_BYTES + SHARD_BYTES, 2 * SHARD_BYTES),
        3: (SHARD_BYTES, WEIGHT_BYTES + SHARD_BYTES, 2 * SHARD_BYTES),
    }[zero]
    for m in memory:
        assert (m.parameters, m.gradients, m.optimizer_state) == (params, grads, state + 2 * F32)
        if zero == 3:
            # Both buckets gathered, plus both reductions in flight when the weight's starts:
            # the flat gradients (6 and 16 elements) and their output shards (3 and 8).
            assert m.communication == PADDED_BYTES + (6 + 3 + 16 + 8) * F32


@pytest.mark.parametrize(
    ("zero", "kind", "message"),
    [
        (0, NodeKind.REDUCE_SCATTER, r"reduce_scatter does not apply to bucket:s0:0 \(parameters full, "
         "gradients full, optimizer state full"),
        (3, NodeKind.ALL_GATHER, r"all_gather does not apply to bucket:s0:0 \(parameters sharded"),
        (1, NodeKind.MATERIALIZE, r"materialize does not apply to bucket:s0:0 \(parameters full, "
         "gradients full, optimizer state sharded"),
    ],
)
def test_setup_rejects_bucket_operations_the_residency_does_not_call_for(
    zero: int, kind: NodeKind, message: str
) -> None:
    """Checked before joining the process group, so no Ray and no peers are needed."""
    program = dp_program(zero)
    bad = _coll(kind, "bad", BUCKETS[0])
    program = attrs.evolve(
        program, ranks=(RankPlan(0, (*program.ranks[0].instructions, bad)), program.ranks[1])
    )
    worker = RankWorker(own_process=False)  # a thread of this process, as the local runtime makes it
    with pytest.raises(ExecutionError, match=message):
        worker.setup(
            0,
            N,
            "127.0.0.1",
            1,
            program,
            {"s0": Stage(nn.Linear(D_IN, D_OUT)), "loss": MSE()},
            OptimizerSpec(),
        )
