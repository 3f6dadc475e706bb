"""Memory estimates on a hand-built 2-rank program (GPipe vs 1F1B-like order on rank 1)."""

from __future__ import annotations

import pytest

from piper_ir import (
    Instruction,
    NodeKind,
    Phase,
    Program,
    RankPlan,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
    Value,
)
from piper_memory import MemoryEstimate, estimate_memory

M = 4


def _c(seg: str, phase: Phase, mb: int | None = None) -> Instruction:
    kind = NodeKind.OPTIMIZER if phase is Phase.OPT else NodeKind.COMPUTE
    return Instruction(f"{phase.value}.{seg}.mb{mb}", kind, segment=seg, phase=phase, microbatch=mb)


def _program(interleave: bool) -> Program:
    f32 = "float32"
    values = (
        Value("input:0", TensorMeta((2, 3), f32, 0)),
        Value("v:h", TensorMeta((2, 5), f32, 0, True)),  # 40 bytes per microbatch
        Value("v:y", TensorMeta((2, 2), f32, 0, True)),  # 16 bytes
        Value("target:0", TensorMeta((2, 2), f32, 0)),
        Value("v:loss", TensorMeta((), f32)),  # 4 bytes
    )
    w = TensorMeta((5, 3), f32)  # 60 bytes
    segments = (
        Segment("s0", SegmentRole.STAGE, Tags.of(PP=0), ("input:0",), ("v:h",), (("l0.weight", w),)),
        Segment(
            "s1",
            SegmentRole.STAGE,
            Tags.of(PP=1),
            ("v:h",),
            ("v:y",),
            (("l1.weight", TensorMeta((2, 5), f32)),),
        ),
        Segment("loss", SegmentRole.LOSS, Tags.of(PP=1), ("v:y", "target:0"), ("v:loss",)),
    )
    r0 = (
        [_c("s0", Phase.F, i) for i in range(M)]
        + [_c("s0", Phase.B, i) for i in range(M)]
        + [_c("s0", Phase.OPT)]
    )
    if interleave:  # forward-backward alternation: one microbatch live at a time
        r1 = [
            c
            for i in range(M)
            for c in (
                _c("s1", Phase.F, i),
                _c("loss", Phase.F, i),
                _c("loss", Phase.B, i),
                _c("s1", Phase.B, i),
            )
        ]
    else:
        r1 = [c for i in range(M) for c in (_c("s1", Phase.F, i), _c("loss", Phase.F, i))]
        r1 += [c for i in range(M) for c in (_c("loss", Phase.B, i), _c("s1", Phase.B, i))]
    r1.append(_c("s1", Phase.OPT))
    return Program(
        2,
        (RankPlan(0, r0), RankPlan(1, r1)),
        (),
        segments,
        values,
        ("input:0",),
        ("target:0",),
        M,
        (("s0", (0,)), ("s1", (1,)), ("loss", (1,))),
    )


def test_gpipe_holds_every_microbatch() -> None:
    est = estimate_memory(_program(interleave=False), optimizer="adamw")
    assert est[0] == MemoryEstimate(0, 60, 60, 120, 4 * 40)
    assert est[1] == MemoryEstimate(1, 40, 40, 80, 4 * (16 + 4))
    assert est[0].total_bytes == 60 + 60 + 120 + 160


def test_interleaved_order_holds_one_microbatch_and_sgd_has_no_state() -> None:
    est = estimate_memory(_program(interleave=True), optimizer="sgd")
    assert est[1].peak_activation_bytes == 16 + 4
    assert est[1].optimizer_state_bytes == 0
    with pytest.raises(ValueError, match="unknown optimizer"):
        estimate_memory(_program(interleave=True), optimizer="lion")


def test_the_replays_running_totals_follow_every_change() -> None:
    """The replay reads each category's sum from a running total (``_Tally``) instead of
    summing its dict after every instruction: after any sequence of sets, overwrites and
    pops (with and without a default) the total is the sum of what is held."""
    import random

    from piper_memory.estimate import _Tally

    rng = random.Random(0)
    tally = _Tally()
    for _ in range(2000):
        key = rng.randrange(8)
        op = rng.random()
        if op < 0.5:
            tally[key] = rng.randrange(1, 1000)
        elif op < 0.8:
            held = dict(tally).get(key)
            assert tally.pop(key, None) == held
        elif key in tally:
            held = dict(tally)[key]
            assert tally.pop(key) == held
        else:
            with pytest.raises(KeyError):
                tally.pop(key)
        assert tally.total == sum(tally.values())
