"""A loss's backward that takes its stage's backward along (``piper_runtime.rank.compute``).

Which pairs qualify is decided from the rank's plan (``fused_losses``); a fused run must give
bit for bit the gradients and parameters of the same plan run unfused.
"""

from __future__ import annotations

import copy
import socket

import attrs
import pytest
import torch
from torch import nn

from piper_ir import Instruction, NodeKind, Phase, Program, Segment, SegmentRole, Tags
from piper_runtime import OptimizerSpec
from piper_runtime.rank import compute as compute_module
from piper_runtime.rank.compute import fused_losses
from piper_runtime.rank.worker import RankWorker
from piper_runtime.testing import (
    MSE,
    TanhLinear,
    compute,
    linear_params,
    one_rank_two_stages,
    two_stage_segments,
)

M, BATCH, D_IN, D_HID, D_OUT = 4, 8, 3, 5, 2


SEGMENTS = two_stage_segments(D_IN, D_HID, D_OUT)


def _program(instructions: list[Instruction], segments: tuple[Segment, ...] = SEGMENTS) -> Program:
    return one_rank_two_stages(instructions, M, BATCH // M, D_IN, D_HID, D_OUT, segments)


def _one_f_one_b() -> list[Instruction]:
    """1F1B-like on one rank: two microbatches in flight, each backward loss -> s1 -> s0."""
    def forward(i: int) -> list[Instruction]:
        return [compute(s, Phase.F, i) for s in ("s0", "s1", "loss")]

    def backward(i: int) -> list[Instruction]:
        return [compute(s, Phase.B, i) for s in ("loss", "s1", "s0")]

    out = forward(0) + forward(1)
    for i in range(M):
        out += backward(i) + (forward(i + 2) if i + 2 < M else [])
    return out + [compute("s0", Phase.OPT), compute("s1", Phase.OPT)]


def test_a_loss_backward_followed_by_its_stage_backward_is_fused():
    plan = _one_f_one_b()
    assert fused_losses(_program(plan), plan) == {("loss", i): "s1" for i in range(M)}


@pytest.mark.parametrize(
    "change", ["split", "apart", "overlap", "stream", "waits", "recompute", "loss_params", "shared"]
)
def test_pairs_that_do_not_qualify(change: str):
    plan = _one_f_one_b()
    segments = SEGMENTS
    first = next(k for k, ins in enumerate(plan) if ins.segment == "s1" and ins.phase is Phase.B)
    if change == "split":  # a split backward of the stage (zero bubble): BI and BW
        plan[first:first + 1] = [compute("s1", Phase.BI, 0), compute("s1", Phase.BW, 0)]
    elif change == "apart":  # something between the two
        plan.insert(first, Instruction("mark", NodeKind.MARKER))
    elif change == "overlap":  # DualPipe's overlapped slot
        plan[first] = attrs.evolve(plan[first], overlap=3)
    elif change == "stream":
        plan[first] = attrs.evolve(plan[first], stream="other")
    elif change == "waits":  # ZeRO-2/3: the previous microbatch's reduce-scatter must come first
        plan[first] = attrs.evolve(plan[first], waits=("ev.reducescatter.bucket:s1:0.mb3",))
    elif change == "recompute":
        segments = (SEGMENTS[0], attrs.evolve(SEGMENTS[1], recompute=True), SEGMENTS[2])
    elif change == "loss_params":  # a loss with weights of its own (a head): its own weight pass
        segments = (*SEGMENTS[:2], attrs.evolve(SEGMENTS[2], params=linear_params("head", D_OUT, D_OUT)))
    elif change == "shared":  # the stage's output also goes elsewhere: its gradient has two parts
        segments = (*SEGMENTS, Segment("probe", SegmentRole.LOSS, Tags.of(PP=1), ("v:y",), ("v:loss",)))
    pairs = fused_losses(_program(plan, segments), plan)
    if change in ("split", "apart", "overlap", "stream", "waits"):
        assert ("loss", 0) not in pairs and ("loss", 1) in pairs  # only microbatch 0 was changed
    else:
        assert pairs == {}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(monkeypatch: pytest.MonkeyPatch, fuse: bool) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor], int]:
    """Two AdamW steps of the 1F1B-like plan; the gradients of each, the parameters after,
    and how many fused backwards ran."""
    fused_calls = []
    original = compute_module.SegmentCompute._fused_backward

    def counted(self, *args):
        fused_calls.append(args[2])
        return original(self, *args)

    monkeypatch.setattr(compute_module.SegmentCompute, "_fused_backward", counted)
    if not fuse:
        monkeypatch.setattr(compute_module, "fused_losses", lambda program, instructions: {})
    torch.manual_seed(0)
    l0, l1 = nn.Linear(D_IN, D_HID), nn.Linear(D_HID, D_OUT)
    modules = {"s0": TanhLinear("l0", copy.deepcopy(l0)), "s1": TanhLinear("l1", copy.deepcopy(l1)), "loss": MSE()}
    worker = RankWorker(own_process=False)  # a thread of this process, as the local runtime makes it
    try:
        worker.setup(0, 1, "127.0.0.1", _port(), _program(_one_f_one_b()), modules, OptimizerSpec("adamw", lr=0.1))
        grads = []
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, t = torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)
            grads.append(worker.run_step({"input:0": x, "target:0": t}, keep_grads=True).grads)
        return grads, worker.parameters(), len(fused_calls)
    finally:
        worker.shutdown()
        monkeypatch.undo()


def test_fused_and_unfused_runs_are_bitwise_equal(monkeypatch: pytest.MonkeyPatch):
    fused_grads, fused_params, fused_calls = _train(monkeypatch, fuse=True)
    grads, params, calls = _train(monkeypatch, fuse=False)
    assert (fused_calls, calls) == (2 * M, 0)  # every microbatch of both steps fused, or none
    for a, b in zip(fused_grads, grads, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    for name in params:
        assert torch.equal(fused_params[name], params[name]), name
