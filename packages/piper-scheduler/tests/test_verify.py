"""verify: compiled plans pass; each kind of broken plan is rejected with its own message."""

from __future__ import annotations

import attrs
import pytest

from piper_ir import (
    Bucket,
    Communicator,
    DeadlockError,
    Instruction,
    NodeKind,
    Phase,
    Program,
    RankPlan,
    SchedulingError,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
    Value,
)
from piper_scheduler import compile_program, verify
from piper_scheduler.testing import pipeline_graph

META = TensorMeta((2, 4), "float32", batch_dim=0)


def comp(id: str, mb: int = 0, **kw) -> Instruction:
    return Instruction(id, NodeKind.COMPUTE, segment="s0", phase=Phase.F, microbatch=mb, **kw)


def send(value: str, mb: int, peer: int, **kw) -> Instruction:
    return Instruction(
        f"send.{value}.{mb}",
        NodeKind.SEND,
        stream="pp",
        value=value,
        microbatch=mb,
        peer=peer,
        communicator="pp.fwd",
        meta=META,
        **kw,
    )


def recv(value: str, mb: int, peer: int, **kw) -> Instruction:
    return Instruction(
        f"recv.{value}.{mb}",
        NodeKind.RECV,
        stream="pp",
        value=value,
        microbatch=mb,
        peer=peer,
        communicator="pp.fwd",
        meta=META,
        **kw,
    )


def allreduce(id: str) -> Instruction:
    return Instruction(id, NodeKind.ALL_REDUCE, stream="dp", value="b", communicator="dp", meta=META)


def program(*plans: list[Instruction]) -> Program:
    ranks = tuple(range(len(plans)))
    return Program(
        world_size=len(plans),
        ranks=[RankPlan(r, ins) for r, ins in enumerate(plans)],
        communicators=[Communicator("pp.fwd", ranks, "activations"), Communicator("dp", ranks, "gradients")],
        segments=[Segment("s0", SegmentRole.STAGE, Tags(), (), (), (("w", META),))],
        values=[Value("a", META), Value("b", META)],
        inputs=(),
        targets=(),
        microbatches=2,
        buckets=[Bucket("b", "s0", ("w",), META.numel())],
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", None])
@pytest.mark.parametrize(("pp", "mb"), [(2, 2), (3, 5), (4, 8)])
def test_compiled_pipelines_verify(schedule: str | None, pp: int, mb: int) -> None:
    verify(compile_program(pipeline_graph(pp, mb, schedule)))


def test_sound_hand_made_program_passes() -> None:
    """s0 on rank 0 writes ``a`` for both microbatches, s1 on rank 1 reads it; events order
    the pp stream after the forwards and the forwards after the receives."""
    two = Segment("s1", SegmentRole.STAGE, Tags(), ("a",), (), ())
    sound = program(
        [comp("f0", record="ev.f0"), send("a", 0, 1, waits=("ev.f0",)), comp("f1", 1, record="ev.f1"),
         send("a", 1, 1, waits=("ev.f1",)), allreduce("ar0")],
        [recv("a", 0, 0, record="ev.r0"), recv("a", 1, 0, record="ev.r1"),
         attrs.evolve(comp("g0", waits=("ev.r0",)), segment="s1"),
         attrs.evolve(comp("g1", 1, waits=("ev.r1",)), segment="s1"), allreduce("ar0")],
    )
    s0 = attrs.evolve(sound.segments[0], outputs=("a",))
    verify(attrs.evolve(sound, segments=(s0, two)))


def test_swapped_receives_are_rejected() -> None:
    bad = program([send("a", 0, 1), send("a", 1, 1)], [recv("a", 1, 0), recv("a", 0, 0)])
    with pytest.raises(DeadlockError) as err:
        verify(bad)
    text = str(err.value)
    assert "communicator 'pp.fwd', rank 0 -> rank 1: message 0 differs" in text
    assert "rank 0 sends a mb=0 [2, 4]/float32 (send.a.0) but rank 1 receives a mb=1" in text
    assert "recv.a.1  <-- here" in text and "send.a.0  <-- here" in text
    assert err.value.ranks == (0, 1)


def test_meta_mismatch_is_rejected() -> None:
    other = TensorMeta((3, 4), "float32", batch_dim=0)
    bad = program([send("a", 0, 1)], [attrs.evolve(recv("a", 0, 0), meta=other)])
    with pytest.raises(DeadlockError, match=r"sends a mb=0 \[2, 4\]/float32 .* receives a mb=0 \[3, 4\]"):
        verify(bad)


def test_missing_send_is_rejected() -> None:
    bad = program([send("a", 0, 1)], [recv("a", 0, 0), recv("a", 1, 0)])
    with pytest.raises(DeadlockError) as err:
        verify(bad)
    assert "receive with no matching send: rank 1 stream 'pp' instruction 1 recv.a.1" in str(err.value)
    assert "rank 0 sends only 1" in str(err.value)


def test_missing_receive_is_rejected() -> None:
    bad = program([send("a", 0, 1), send("a", 1, 1)], [recv("a", 0, 0)])
    with pytest.raises(
        DeadlockError, match="send with no matching receive: rank 0 stream 'pp' instruction 1 send.a.1"
    ):
        verify(bad)


def test_collectives_in_different_orders_are_rejected() -> None:
    bad = program([allreduce("ar.x"), allreduce("ar.y")], [allreduce("ar.y"), allreduce("ar.x")])
    with pytest.raises(DeadlockError) as err:
        verify(bad)
    assert (
        "communicator 'dp': collective 0 differs between members: rank 0 issues ar.x but rank 1 issues ar.y"
        in str(err.value)
    )
    assert "ar.y  <-- here" in str(err.value)


def test_collective_missing_on_one_member_is_rejected() -> None:
    bad = program([allreduce("ar.x")], [comp("b")])
    with pytest.raises(DeadlockError, match="rank 0 issues ar.x but rank 1 issues nothing"):
        verify(bad)


def test_event_never_recorded_is_rejected() -> None:
    bad = program([comp("a"), comp("b", waits=("ev.nowhere",))])
    with pytest.raises(SchedulingError) as err:
        verify(bad)
    assert "rank 0 stream 'compute' instruction 1 b" in str(err.value)
    assert "waits on event 'ev.nowhere', which is never recorded on rank 0" in str(err.value)
    assert "b  <-- here" in str(err.value)


def test_event_recorded_later_is_rejected() -> None:
    bad = program([comp("a", waits=("ev.b",)), comp("b", record="ev.b")])
    with pytest.raises(
        SchedulingError, match="waits on event 'ev.b', which is recorded later, by instruction 1"
    ):
        verify(bad)


def test_event_recorded_twice_is_rejected() -> None:
    bad = program([comp("a", record="ev.x"), comp("b", record="ev.x")])
    with pytest.raises(SchedulingError, match="event 'ev.x' is recorded twice on rank 0"):
        verify(bad)


def test_receive_before_send_cycle_deadlocks() -> None:
    bad = program([recv("b", 0, 1), send("a", 0, 1)], [recv("a", 0, 0), send("b", 0, 0)])
    with pytest.raises(DeadlockError) as err:
        verify(bad)
    text = str(err.value)
    assert "deadlock: ranks block forever" in text
    assert (
        "rank 0 stream 'pp' instruction 0 recv.b.0 (RECV b#0 <-1) waits for send.b.0 (instruction 1 of rank 1"
        in text
    )
    assert "rank 1 stream 'pp' instruction 0 recv.a.0" in text
    assert text.count("<-- here") == 2


def test_collective_behind_a_blocked_receive_deadlocks() -> None:
    bad = program([allreduce("ar"), send("a", 0, 1)], [recv("a", 0, 0), allreduce("ar")])
    with pytest.raises(
        DeadlockError, match="rank 0 stream 'dp' instruction 0 ar .* waits for every member of 'dp'"
    ):
        verify(bad)


def test_bad_peer_and_unknown_communicator_are_rejected() -> None:
    with pytest.raises(SchedulingError, match="has invalid peer 0"):
        verify(program([send("a", 0, 0)]))
    with pytest.raises(SchedulingError, match="unknown communicator 'nope'"):
        verify(program([attrs.evolve(send("a", 0, 1), communicator="nope")], []))


def test_duplicate_instruction_id_is_rejected() -> None:
    with pytest.raises(SchedulingError, match="instruction id 'a' appears twice on rank 0"):
        verify(program([comp("a"), comp("a")]))
