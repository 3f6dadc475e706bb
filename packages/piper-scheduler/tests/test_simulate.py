"""simulate: pipeline bubble formulas, activation memory, transfers, collectives, deadlock."""

from __future__ import annotations

import math

import pytest

from piper_ir import Communicator, DeadlockError, Instruction, NodeKind, Phase, Program, RankPlan, TensorMeta
from piper_scheduler import CostModel, compile_program, simulate
from piper_scheduler.testing import pipeline_graph

FREE_LOSS = {"loss": {"F": 0, "B": 0}}
CASES = [(2, 1), (2, 4), (3, 3), (3, 6), (4, 4), (4, 8), (5, 7)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("f", "b"), [(1.0, 2.0), (1.0, 3.0)])
@pytest.mark.parametrize(("pp", "mb"), CASES)
def test_pipeline_bubble(schedule: str, f: float, b: float, pp: int, mb: int) -> None:
    timeline = simulate(
        compile_program(pipeline_graph(pp, mb, schedule)), CostModel(F=f, B=b, overrides=FREE_LOSS)
    )
    assert timeline.makespan == (mb + pp - 1) * (f + b)
    assert timeline.busy == (mb * (f + b),) * pp
    assert timeline.idle == ((pp - 1) * (f + b),) * pp


@pytest.mark.parametrize(("pp", "mb"), CASES)
def test_activation_memory(pp: int, mb: int) -> None:
    costs = CostModel(overrides=FREE_LOSS)
    gpipe = simulate(compile_program(pipeline_graph(pp, mb, "gpipe")), costs)
    one_f_one_b = simulate(compile_program(pipeline_graph(pp, mb, "1f1b")), costs)
    assert gpipe.peak_memory == (mb,) * pp
    assert one_f_one_b.peak_memory == tuple(min(pp - r, mb) for r in range(pp))


def test_transfer_costs_delay_the_consumer() -> None:
    # bytes per activation: 2 x 8 float32 = 64; latency 0.25 + 64 / 256 = 0.5 per transfer.
    costs = CostModel(overrides=FREE_LOSS, latency=0.25, bandwidth=256.0)
    timeline = simulate(compile_program(pipeline_graph(2, 1, "gpipe")), costs)
    # F0 [0,1], send [1,1.5], F1 [1.5,2.5], B1 [2.5,4.5], send grad [4.5,5], B0 [5,7]
    assert timeline.makespan == 7.0
    spans = {iv.instruction: (iv.start, iv.end) for iv in timeline.intervals}
    assert spans["send.v:s0.mb0.0-1"] == (1.0, 1.5)
    assert spans["recv.v:s0.mb0.0-1"] == (1.0, 1.5)
    assert spans["F.s1.mb0"] == (1.5, 2.5)
    assert spans["B.s0.mb0"] == (5.0, 7.0)
    assert timeline.idle == (4.0, 4.0)


def test_cost_model_overrides_and_defaults() -> None:
    costs = CostModel(overrides={"s1": {"F": 5}})
    assert costs.compute_cost("s1", Phase.F) == 5.0
    assert costs.compute_cost("s1", Phase.B) == 2.0
    assert costs.compute_cost("s0", Phase.OPT) == 0.0
    assert costs.comm_cost(TensorMeta((1024,), "float32")) == 0.0
    assert math.isinf(CostModel().bandwidth)
    assert hash(costs) == hash(CostModel(overrides=(("s1", "F", 5),)))


def _program(*plans: list[Instruction]) -> Program:
    ranks = tuple(range(len(plans)))
    return Program(
        len(plans),
        [RankPlan(r, p) for r, p in enumerate(plans)],
        [Communicator("dp", ranks, "gradients")],
        (),
        (),
        (),
        (),
    )


def test_collective_starts_when_every_member_arrives() -> None:
    meta = TensorMeta((4,), "float32")

    def f(id: str, seg: str) -> Instruction:
        return Instruction(id, NodeKind.COMPUTE, segment=seg, phase=Phase.F, microbatch=0, record=f"ev.{id}")

    def ar(waits: str) -> Instruction:
        return Instruction(
            "ar", NodeKind.ALL_REDUCE, stream="dp", communicator="dp", meta=meta, waits=(waits,)
        )

    program = _program([f("a", "s0"), ar("ev.a")], [f("b", "s1"), ar("ev.b")])
    timeline = simulate(program, CostModel(overrides={"s1": {"F": 3}}, latency=1.0))
    spans = [(iv.rank, iv.instruction, iv.start, iv.end) for iv in timeline.intervals]
    assert spans == [(0, "a", 0.0, 1.0), (0, "ar", 3.0, 4.0), (1, "b", 0.0, 3.0), (1, "ar", 3.0, 4.0)]
    assert timeline.busy == (1.0, 3.0) and timeline.idle == (3.0, 1.0)


def test_streams_overlap_on_one_rank() -> None:
    meta = TensorMeta((4,), "float32")
    program = _program(
        [
            Instruction("a", NodeKind.COMPUTE, segment="s0", phase=Phase.F, microbatch=0, record="ev.a"),
            Instruction(
                "ar", NodeKind.ALL_REDUCE, stream="dp", communicator="dp", meta=meta, waits=("ev.a",)
            ),
            Instruction("b", NodeKind.COMPUTE, segment="s0", phase=Phase.F, microbatch=1),
        ]
    )
    timeline = simulate(program, CostModel(latency=5.0))
    spans = {iv.instruction: (iv.start, iv.end) for iv in timeline.intervals}
    assert spans == {"a": (0.0, 1.0), "ar": (1.0, 6.0), "b": (1.0, 2.0)}
    assert timeline.makespan == 6.0


def test_unverified_deadlock_is_reported() -> None:
    meta = TensorMeta((4,), "float32")
    recv = Instruction(
        "r", NodeKind.RECV, stream="pp", value="a", microbatch=0, peer=1, communicator="dp", meta=meta
    )
    send = Instruction(
        "s", NodeKind.SEND, stream="pp", value="a", microbatch=0, peer=0, communicator="dp", meta=meta
    )
    recv1 = Instruction(
        "r1", NodeKind.RECV, stream="pp", value="b", microbatch=0, peer=0, communicator="dp", meta=meta
    )
    send0 = Instruction(
        "s0", NodeKind.SEND, stream="pp", value="b", microbatch=0, peer=1, communicator="dp", meta=meta
    )
    with pytest.raises(DeadlockError, match="simulation cannot finish"):
        simulate(_program([recv, send0], [recv1, send]))


def test_overheads_and_startup_are_charged() -> None:
    from piper_scheduler.testing import pipeline_graph

    program = compile_program(pipeline_graph(2, 2, "1f1b"))
    base = simulate(program, CostModel(overrides={"loss": {"F": 0, "B": 0}}))
    shifted = simulate(program, CostModel(overrides={"loss": {"F": 0, "B": 0}}, startup=5.0))
    assert shifted.makespan == base.makespan + 5.0
    padded = simulate(program, CostModel(overrides={"loss": {"F": 0, "B": 0}}, overhead=0.5))
    computes = sum(1 for ins in program.ranks[0].instructions if ins.kind.value in ("compute", "optimizer"))
    assert padded.busy[0] == base.busy[0] + 0.5 * computes
    comm = simulate(program, CostModel(overrides={"loss": {"F": 0, "B": 0}}, comm_overhead=0.25))
    assert comm.makespan > base.makespan


@pytest.mark.parametrize(("pp", "mb"), CASES)
def test_a_recomputed_segment_pays_its_forward_again_in_its_backward(pp: int, mb: int) -> None:
    """1F1B with every stage recomputed is 1F1B whose backward costs F + B."""
    import attrs

    program = compile_program(pipeline_graph(pp, mb, "1f1b"))
    recomputed = attrs.evolve(program, segments=[attrs.evolve(s, recompute=s.id != "loss") for s in program.segments])
    timeline = simulate(recomputed, CostModel(F=1.0, B=2.0, overrides=FREE_LOSS))
    assert timeline.makespan == (mb + pp - 1) * (1.0 + 3.0)
    assert timeline.busy == (mb * (1.0 + 3.0),) * pp
    assert simulate(program, CostModel(F=1.0, B=2.0, overrides=FREE_LOSS)).makespan == (mb + pp - 1) * 3.0
