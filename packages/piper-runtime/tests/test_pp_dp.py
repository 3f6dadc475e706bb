"""Pipeline x data parallelism on 4 ranks: PP=2 (GPipe, 2 microbatches) x DP=2, against
single-device training with AdamW.

Hand-built as docs/ir-conventions.md section 7 prescribes: stage 0 (Linear + tanh) is
replicated over ranks (0, 1) with ZeRO-3, stage 1 (Linear) and the loss over (2, 3) with
ZeRO-2. Replica j of stage 0 talks only to replica j of stage 1 (rank j <-> rank 2 + j), and
each stage's collectives run on its own communicator (``dp:0-1``, ``dp:2-3``: process
sub-groups). Stage 0 materializes once for its forwards and once for its backwards; stage 1
keeps full parameters, reduce-scatters after each microbatch and re-gathers after its step.
The buckets say so (``piper_memory.zero_residency``: where parameters, gradients and
optimizer state live), as ``plan_memory`` would.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from ray import cloudpickle
from torch import nn

from piper_ir import (
    Bucket,
    Communicator,
    Instruction,
    NodeKind,
    Phase,
    Program,
    RankPlan,
    Replication,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
)
from piper_memory import zero_residency
from piper_runtime import OptimizerSpec, Runtime
from piper_runtime.testing import MSE, compute, tensor_meta, two_stage_values, with_stream_events

cloudpickle.register_pickle_by_value(sys.modules[__name__])

M, N, BATCH, D_IN, D_HID, D_OUT = 2, 2, 8, 3, 4, 2
SHARD = BATCH // (M * N)


class Stage0(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.l0 = lin

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(self.l0(x)),)


class Stage1(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.l1 = lin

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.l1(h),)


# While set, each forward of ``MeetingStage0`` waits for the other replica's (local runtime).
_MEET: threading.Barrier | None = None


class MeetingStage0(Stage0):
    """``Stage0`` whose forward waits, while ``_MEET`` is set, until both replicas are in theirs:
    a ``BrokenBarrierError`` after its timeout where one waits for the other to finish first."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        if _MEET is not None:
            _MEET.wait()
        return super().forward(x)


def pp_dp_program() -> Program:
    h, y = "v:h", "v:y"
    values = two_stage_values(SHARD, D_IN, D_HID, D_OUT)
    meta = {v.name: v.meta for v in values}

    def params(name: str, d_in: int, d_out: int) -> tuple[tuple[str, TensorMeta], ...]:
        return (
            (f"{name}.weight", tensor_meta(d_out, d_in, batch_dim=None)),
            (f"{name}.bias", tensor_meta(d_out, batch_dim=None)),
        )

    segments = (
        Segment("s0", SegmentRole.STAGE, Tags.of(PP=0), ("input:0",), (h,), params("l0", D_IN, D_HID)),
        Segment("s1", SegmentRole.STAGE, Tags.of(PP=1), (h,), (y,), params("l1", D_HID, D_OUT)),
        Segment("loss", SegmentRole.LOSS, Tags.of(PP=1), (y, "target:0"), ("v:loss",)),
    )
    # One bucket per segment: 12 + 4 = 16 (s0) and 8 + 2 = 10 (s1) elements.
    buckets = (
        Bucket("bucket:s0:0", "s0", ("l0.weight", "l0.bias"), D_HID * D_IN + D_HID, N, **zero_residency(3)),
        Bucket("bucket:s1:0", "s1", ("l1.weight", "l1.bias"), D_OUT * D_HID + D_OUT, N, **zero_residency(2)),
    )

    def p2p(kind: NodeKind, value: str, mb: int, src: int, dst: int) -> Instruction:
        comm = "pp.bwd" if value.startswith("grad:") else "pp.fwd"
        peer = dst if kind is NodeKind.SEND else src
        return Instruction(
            f"{kind.value}.{value}.mb{mb}.{src}-{dst}",
            kind,
            stream="pp",
            microbatch=mb,
            value=value,
            peer=peer,
            communicator=comm,
            meta=meta[value],
        )

    def coll(
        kind: NodeKind, name: str, seg: str, comm: str, mb: int | None = None, k: int | None = None
    ) -> Instruction:
        bucket = f"bucket:{seg}:0"
        ident = f"{name}.{bucket}" + ("" if mb is None else f".mb{mb}") + ("" if k is None else f".{k}")
        return Instruction(
            ident, kind, stream="dp", segment=seg, microbatch=mb, value=bucket, communicator=comm
        )

    def stage0(r: int) -> list[Instruction]:
        dp, peer = "dp:0-1", 2 + r
        ins = [coll(NodeKind.MATERIALIZE, "materialize", "s0", dp, k=0)]
        for i in range(M):
            ins += [compute("s0", Phase.F, i), p2p(NodeKind.SEND, h, i, r, peer)]
        ins += [
            coll(NodeKind.FREE, "free", "s0", dp, k=0),
            coll(NodeKind.MATERIALIZE, "materialize", "s0", dp, k=1),
        ]
        for i in range(M):
            ins += [
                p2p(NodeKind.RECV, f"grad:{h}", i, peer, r),
                compute("s0", Phase.B, i),
                coll(NodeKind.REDUCE_SCATTER, "reducescatter", "s0", dp, mb=i),
            ]
        return [*ins, coll(NodeKind.FREE, "free", "s0", dp, k=1), compute("s0", Phase.OPT)]

    def stage1(r: int) -> list[Instruction]:
        dp, peer = "dp:2-3", r - 2
        ins: list[Instruction] = []
        for i in range(M):
            ins += [p2p(NodeKind.RECV, h, i, peer, r), compute("s1", Phase.F, i), compute("loss", Phase.F, i)]
        for i in range(M):
            ins += [
                compute("loss", Phase.B, i),
                compute("s1", Phase.B, i),
                p2p(NodeKind.SEND, f"grad:{h}", i, r, peer),
                coll(NodeKind.REDUCE_SCATTER, "reducescatter", "s1", dp, mb=i),
            ]
        return [*ins, compute("s1", Phase.OPT), coll(NodeKind.ALL_GATHER, "allgather", "s1", dp)]

    return Program(
        world_size=4,
        ranks=(
            RankPlan(0, with_stream_events(stage0(0)), replica=0),
            RankPlan(1, with_stream_events(stage0(1)), replica=1),
            RankPlan(2, with_stream_events(stage1(2)), replica=0),
            RankPlan(3, with_stream_events(stage1(3)), replica=1),
        ),
        communicators=(
            Communicator("pp.fwd", (0, 1, 2, 3), "activations"),
            Communicator("pp.bwd", (0, 1, 2, 3), "gradients"),
            Communicator("dp:0-1", (0, 1), "dp"),
            Communicator("dp:2-3", (2, 3), "dp"),
        ),
        segments=segments,
        values=values,
        inputs=("input:0",),
        targets=("target:0",),
        microbatches=M,
        placement=(("s0", (0, 1)), ("s1", (2, 3)), ("loss", (2, 3))),
        replicas=N,
        replication=(Replication("s0", (0, 1), zero=3), Replication("s1", (2, 3), zero=2)),
        buckets=buckets,
    )


@pytest.mark.parametrize("runtime", ["ray", "local"])
def test_pp2_dp2_zero3_and_zero2_match_single_device(ray_cluster, runtime: str) -> None:
    """Also on the local runtime, where the two replicas of each stage are threads of this
    process whose forwards meet (``MeetingStage0``) from the second step on: forwards that draw
    no random numbers run side by side, not in turns (``piper_runtime.rank.randomness``)."""
    global _MEET
    torch.manual_seed(0)
    l0, l1 = nn.Linear(D_IN, D_HID), nn.Linear(D_HID, D_OUT)
    ref = nn.ModuleDict({"l0": nn.Linear(D_IN, D_HID), "l1": nn.Linear(D_HID, D_OUT)})
    ref.load_state_dict(
        {
            **{f"l0.{k}": v for k, v in l0.state_dict().items()},
            **{f"l1.{k}": v for k, v in l1.state_dict().items()},
        }
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    spec = OptimizerSpec("adamw", lr=0.05)

    def model(x: torch.Tensor) -> torch.Tensor:
        return ref["l1"](torch.tanh(ref["l0"](x)))

    modules = {"s0": MeetingStage0(l0) if runtime == "local" else Stage0(l0), "s1": Stage1(l1), "loss": MSE()}
    with Runtime(pp_dp_program(), modules, spec, runtime=runtime) as rt:
        for step in range(3):
            _MEET = threading.Barrier(N, timeout=10.0) if step > 0 and runtime == "local" else None
            g = torch.Generator().manual_seed(300 + step)
            x, t = torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)
            result = rt.step((x,), (t,), keep_grads=True, memory=True)
            with torch.no_grad():
                ref_losses = [
                    nn.functional.mse_loss(model(xc), tc).item()
                    for xc, tc in zip(x.chunk(M), t.chunk(M), strict=True)
                ]
            ref_opt.zero_grad()
            nn.functional.mse_loss(model(x), t).backward()
            assert result.losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
            assert set(result.grads) == {n for n, _ in ref.named_parameters()}
            for name, p in ref.named_parameters():
                torch.testing.assert_close(result.grads[name], p.grad, rtol=1e-5, atol=1e-6)
            ref_opt.step()
            # Received activations and gradients are communication buffers on every rank.
            assert all(m.communication > 0 for m in result.memory)
        params = rt.parameters()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)
