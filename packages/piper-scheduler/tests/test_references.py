"""verify checks every reference and count: one broken program per message, each rejected
with a ``SchedulingError`` that names the culprit (the rank and instruction, or the table)."""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs
import pytest

from piper_ir import (
    Bucket,
    Communicator,
    Instruction,
    NodeKind,
    ParamShard,
    Phase,
    Precision,
    Program,
    RankPlan,
    Replication,
    SchedulingError,
    Segment,
    SegmentRole,
    Sharding,
    Tags,
    TensorMeta,
    Tie,
    Value,
)
from piper_scheduler import compile_program, verify
from piper_scheduler.testing import pipeline_graph

PP = compile_program(pipeline_graph(2, 2, "1f1b"))
META = TensorMeta((2, 3), "float32", batch_dim=0)
FLAT = TensorMeta((6,), "float32")  # bucket b0: 5 elements in 2 shards of 3, padded to 6
PARAMS = (("w", TensorMeta((2, 2), "float32")), ("u", TensorMeta((4,), "float32")), ("b", TensorMeta((1,), "float32")))


def _dp_program() -> Program:
    """Segment s0 on ranks 0 and 1, expert-parallel (expert weight ``w``) and data-parallel
    with ZeRO-1 for the rest: bucket b0 (``u`` and ``b``) reduce-scattered after the
    backward and all-gathered after the step (events order the dp stream after compute)."""

    def plan(rank: int) -> RankPlan:
        return RankPlan(
            rank,
            [
                Instruction("F.s0.mb0", NodeKind.COMPUTE, segment="s0", phase=Phase.F, microbatch=0),
                Instruction("B.s0.mb0", NodeKind.COMPUTE, segment="s0", phase=Phase.B, microbatch=0, record="ev.B"),
                Instruction("rs.b0", NodeKind.REDUCE_SCATTER, "dp", "s0", value="b0", communicator="dp:0-1", meta=FLAT,
                            waits=("ev.B",), record="ev.rs"),
                Instruction("OPT.s0", NodeKind.OPTIMIZER, segment="s0", phase=Phase.OPT, waits=("ev.rs",), record="ev.OPT"),
                Instruction("ag.b0", NodeKind.ALL_GATHER, "dp", "s0", value="b0", communicator="dp:0-1", meta=FLAT,
                            waits=("ev.OPT",)),
            ],
            replica=rank,
        )

    return Program(
        world_size=2,
        ranks=[plan(0), plan(1)],
        communicators=[Communicator("dp:0-1", (0, 1), "dp")],
        segments=[Segment("s0", SegmentRole.STAGE, Tags(), ("x",), ("y",), PARAMS)],
        values=[Value("x", META), Value("y", META)],
        inputs=("x",),
        targets=(),
        placement=[("s0", (0, 1))],
        replicas=2,
        replication=[Replication("s0", (0, 1), zero=1)],
        buckets=[Bucket("b0", "s0", ("u", "b"), 5, shards=2)],
        sharding=[Sharding("s0", (0, 1), "ep", 2, (ParamShard("w", 0),), 0)],
    )


DP = _dp_program()


def test_the_base_programs_verify() -> None:
    verify(PP)
    verify(DP)


def _changed(program: Program, rank: int, index: int, **changes: object) -> Program:
    """``program`` with instruction ``index`` of ``rank`` changed."""
    plan = program.ranks[rank]
    ins = list(plan.instructions)
    ins[index] = attrs.evolve(ins[index], **changes)
    ranks = list(program.ranks)
    ranks[rank] = attrs.evolve(plan, instructions=ins)
    return attrs.evolve(program, ranks=ranks)


def _index(program: Program, rank: int, kind: NodeKind) -> int:
    return next(i for i, ins in enumerate(program.ranks[rank].instructions) if ins.kind is kind)


def _send(program: Program) -> tuple[int, int]:
    return 0, _index(program, 0, NodeKind.SEND)


TABLES: list[tuple[str, Callable[[], Program], str]] = [
    ("microbatches", lambda: attrs.evolve(PP, microbatches=-1), "the program's microbatches is -1; it must be positive"),
    ("world size", lambda: attrs.evolve(PP, world_size=0, ranks=()), "the program's world_size is 0"),
    ("replicas", lambda: attrs.evolve(PP, replicas=0), "the program's replicas is 0"),
    ("replica", lambda: attrs.evolve(DP, ranks=[DP.ranks[0], attrs.evolve(DP.ranks[1], replica=2)]),
     "rank 1 is replica 2, outside [0, 2)"),
    ("segment twice", lambda: attrs.evolve(PP, segments=PP.segments + PP.segments[:1]), "the program has two segments 's0'"),
    ("value twice", lambda: attrs.evolve(PP, values=PP.values + PP.values[:1]), "the program has two values 'input:0'"),
    ("communicator twice", lambda: attrs.evolve(PP, communicators=PP.communicators * 2),
     "the program has two communicators 'pp.fwd'"),
    ("bucket twice", lambda: attrs.evolve(DP, buckets=DP.buckets * 2), "the program has two buckets 'b0'"),
    ("placed twice", lambda: attrs.evolve(PP, placement=PP.placement + PP.placement[:1]),
     "the program has two placements of segment 's0'"),
    ("inputs", lambda: attrs.evolve(PP, inputs=("input:9",)),
     "the program's inputs name value 'input:9', which the program does not have"),
    ("targets", lambda: attrs.evolve(PP, targets=("target:9",)),
     "the program's targets name value 'target:9', which the program does not have"),
    ("segment value", lambda: attrs.evolve(DP, segments=[attrs.evolve(DP.segments[0], outputs=("ghost",))]),
     "segment s0 uses value 'ghost', which the program does not have"),
    ("empty communicator", lambda: attrs.evolve(DP, communicators=[Communicator("dp:0-1", (), "dp")]),
     "communicator 'dp:0-1' holds no ranks"),
    ("communicator rank", lambda: attrs.evolve(DP, communicators=[Communicator("dp:0-1", (0, 5), "dp")]),
     "communicator 'dp:0-1' names rank 5, outside world size 2"),
    ("communicator rank twice", lambda: attrs.evolve(DP, communicators=[Communicator("dp:0-1", (0, 1, 1), "dp")]),
     "communicator 'dp:0-1' names a rank twice: [0, 1, 1]"),
    ("placement segment", lambda: attrs.evolve(PP, placement=(*PP.placement, ("s7", (0,)))),
     "the placement names segment 's7', which the program does not have"),
    ("placement rank", lambda: attrs.evolve(DP, placement=[("s0", (0, -1))]),
     "the placement of segment s0 names rank -1, outside world size 2"),
    ("replication segment", lambda: attrs.evolve(DP, replication=[Replication("s7", (0, 1))]),
     "a replication names segment 's7', which the program does not have"),
    ("replication level", lambda: attrs.evolve(DP, replication=[Replication("s0", (0, 1), zero=4)]),
     "the replication of segment s0 has ZeRO level 4 and bucket size"),
    ("bucket segment", lambda: attrs.evolve(DP, buckets=[attrs.evolve(DP.buckets[0], segment="s7")]),
     "bucket b0 names segment 's7', which the program does not have"),
    ("bucket size", lambda: attrs.evolve(DP, buckets=[attrs.evolve(DP.buckets[0], shards=0)]),
     "bucket b0 has 5 elements in 0 shards; both must be positive"),
    ("bucket parameter", lambda: attrs.evolve(DP, buckets=[attrs.evolve(DP.buckets[0], params=("u", "q"))]),
     "bucket b0 holds parameter 'q', which segment s0 does not have"),
    ("bucket mirror", lambda: attrs.evolve(DP, buckets=[attrs.evolve(DP.buckets[0], mirrors=("b9",))]),
     "bucket b0 mirrors bucket 'b9', which the program does not have"),
    ("sharding segment", lambda: attrs.evolve(DP, sharding=[attrs.evolve(DP.sharding[0], segment="s7")]),
     "a sharding names segment 's7', which the program does not have"),
    ("sharding parameter", lambda: attrs.evolve(DP, sharding=[attrs.evolve(DP.sharding[0], params=(ParamShard("q", 0),))]),
     "the sharding of segment s0 cuts parameter 'q', which segment s0 does not have"),
    ("sharding degree", lambda: attrs.evolve(DP, sharding=[attrs.evolve(DP.sharding[0], degree=3)]),
     "the sharding of segment s0 has degree 3 over 2 devices"),
    ("tie twice", lambda: attrs.evolve(PP, ties=[_tie(PP)] * 2), "the program has two ties 's0.weight'"),
    ("tie holders", lambda: attrs.evolve(PP, ties=[Tie("w", [("s0", "s0.weight")])]), "tie 'w' names fewer than two segments"),
    ("tie segment", lambda: attrs.evolve(PP, ties=[Tie("w", [("s0", "s0.weight"), ("s7", "w")])]),
     "tie 'w' names segment 's7', which the program does not have"),
    ("tie parameter", lambda: attrs.evolve(PP, ties=[Tie("w", [("s0", "s0.weight"), ("s1", "q")])]),
     "tie 'w' names parameter 'q', which segment s1 does not have"),
    ("tie not summed", lambda: attrs.evolve(PP, ties=[_tie(PP)]),
     "tie 's0.weight' is held on ranks [0, 1], but no bucket of its own sums its gradient on ranks [0, 1]"),
    ("precision", lambda: attrs.evolve(PP, precision=Precision("int8")),
     "the program's compute precision 'int8' is not one of"),
]


def _tie(program: Program) -> Tie:
    """A tie of the first parameters of s0 and s1 (any two do for the table checks)."""
    seg = program.segment_by_id
    return Tie(seg["s0"].params[0][0], [("s0", seg["s0"].params[0][0]), ("s1", seg["s1"].params[0][0])])


@pytest.mark.parametrize(("broken", "message"), [c[1:] for c in TABLES], ids=[c[0] for c in TABLES])
def test_bad_table_or_count_is_rejected(broken: Callable[[], Program], message: str) -> None:
    with pytest.raises(SchedulingError, match=re.escape(message)):
        verify(broken())


def _deleted_segment() -> Program:
    return attrs.evolve(
        PP,
        segments=[s for s in PP.segments if s.id != "s1"],
        placement=[p for p in PP.placement if p[0] != "s1"],
    )


def _opt(program: Program, rank: int = 0) -> int:
    return _index(program, rank, NodeKind.OPTIMIZER)


# (name, broken program, rank, index of the culprit, message after the instruction's name)
INSTRUCTIONS: list[tuple[str, Callable[[], Program], int, int, str]] = [
    ("unknown segment", lambda: _changed(PP, 0, 0, segment="s9"), 0, 0,
     "names segment 's9', which the program does not have"),
    ("deleted segment", _deleted_segment, 1, 1, "names segment 's1', which the program does not have"),
    ("microbatch", lambda: _changed(PP, 0, 0, microbatch=7), 0, 0, "has microbatch 7, outside [0, 2)"),
    ("negative microbatch", lambda: _changed(PP, 0, 0, microbatch=-1), 0, 0, "has microbatch -1, outside [0, 2)"),
    ("meta", lambda: _changed(PP, *_send(PP), meta=TensorMeta((-2, 8), "float32")), *_send(PP),
     "has a negative dimension in its meta [-2, 8]"),
    ("overlap", lambda: _changed(PP, 0, 0, overlap=-1), 0, 0,
     "has overlap number -1; overlap numbers are non-negative"),
    ("stream", lambda: _changed(PP, 0, 0, stream=""), 0, 0, "has an empty stream name"),
    ("no segment", lambda: _changed(PP, 0, 0, segment=None), 0, 0, "is a compute step without a segment"),
    ("compute phase", lambda: _changed(PP, 0, 0, phase=Phase.OPT), 0, 0,
     "has phase OPT; compute runs F, B, BI or BW"),
    ("compute without phase", lambda: _changed(PP, 0, 0, phase=None), 0, 0,
     "has phase None; compute runs F, B, BI or BW"),
    ("optimizer phase", lambda: _changed(PP, 0, _opt(PP), phase=Phase.F), 0, _opt(PP),
     "has phase F; an optimizer step has phase OPT"),
    ("placement", lambda: attrs.evolve(PP, placement=[("s0", (1,)) if s == "s0" else (s, d) for s, d in PP.placement]),
     0, 0, "runs segment s0, which the program places on ranks [1]"),
    ("no value", lambda: _changed(PP, *_send(PP), value=None), *_send(PP), "carries no value"),
    ("unknown value", lambda: _changed(PP, *_send(PP), value="v:zz"), *_send(PP),
     "carries value 'v:zz', which the program does not have"),
    ("transfer meta", lambda: _changed(PP, *_send(PP), meta=None), *_send(PP),
     "has no meta: the shape and dtype that travel"),
    ("unknown bucket", lambda: _changed(DP, 1, 2, value="b9"), 1, 2,
     "names bucket 'b9', which the program does not have"),
    ("bucket of another segment", lambda: _changed(attrs.evolve(DP, segments=DP.segments + (
        Segment("s1", SegmentRole.STAGE, Tags(), (), ()),)), 0, 2, segment="s1"), 0, 2,
     "names segment s1 but bucket b0 holds parameters of segment s0"),
    ("bucket meta", lambda: _changed(DP, 0, 4, meta=None), 0, 4, "has no meta: the flat bucket it moves"),
    ("bucket size", lambda: _changed(DP, 0, 2, meta=TensorMeta((5,), "float32")), 0, 2,
     "moves 5 elements but bucket b0 has 6"),
    ("mirror sum size", lambda: _changed(DP, 0, 2, kind=NodeKind.ALL_REDUCE), 0, 2,
     "moves 6 elements but bucket b0 has 3"),
]


@pytest.mark.parametrize(
    ("broken", "rank", "index", "message"), [c[1:] for c in INSTRUCTIONS], ids=[c[0] for c in INSTRUCTIONS]
)
def test_bad_reference_of_an_instruction_is_rejected(
    broken: Callable[[], Program], rank: int, index: int, message: str
) -> None:
    program = broken()
    culprit = program.ranks[rank].instructions[index]
    with pytest.raises(SchedulingError) as err:
        verify(program)
    text = str(err.value)
    assert f"rank {rank} stream {culprit.stream!r} instruction {index} {culprit.id} " in text
    assert message in text
    assert err.value.ranks == (rank,) and err.value.nodes == (culprit.id,)
    assert f"{culprit.id}  <-- here" in text
