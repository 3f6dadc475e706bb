"""compile_program: per-rank orders, placement of sends/receives, events, determinism."""

from __future__ import annotations

import pytest

from piper_ir import (
    Edge,
    EdgeKind,
    Graph,
    Node,
    NodeKind,
    Phase,
    Program,
    SchedulingError,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
    Value,
    from_json,
    to_json,
)
from piper_scheduler import compile_program, verify
from piper_scheduler.testing import pipeline_graph, schedule_order


def compute_order(program: Program, rank: int) -> list[tuple[str, Phase, int | None]]:
    return [
        (ins.segment, ins.phase, ins.microbatch)
        for ins in program.ranks[rank].instructions
        if ins.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER)
    ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "mb"), [(1, 3), (2, 1), (2, 4), (3, 2), (4, 6)])
def test_compute_order_follows_schedule(schedule: str, pp: int, mb: int) -> None:
    program = compile_program(pipeline_graph(pp, mb, schedule))
    for rank in range(pp):
        assert compute_order(program, rank) == schedule_order(pp, mb, schedule, rank)


@pytest.mark.parametrize(("pp", "mb"), [(2, 3), (4, 4)])
def test_unordered_graph_runs_gpipe_like(pp: int, mb: int) -> None:
    # The tie-break (phase, microbatch, segment position) alone yields all F then all B.
    program = compile_program(pipeline_graph(pp, mb, schedule=None))
    for rank in range(pp):
        assert compute_order(program, rank) == schedule_order(pp, mb, "gpipe", rank)


def test_sends_follow_producers_and_receives_precede_consumers() -> None:
    program = compile_program(pipeline_graph(3, 2, "1f1b"))
    for plan in program.ranks:
        ins = plan.instructions
        for i, x in enumerate(ins):
            if x.kind is NodeKind.SEND:
                assert ins[i - 1].kind is NodeKind.COMPUTE
                assert ins[i - 1].phase is (Phase.B if x.value.startswith("grad:") else Phase.F)
                assert ins[i - 1].microbatch == x.microbatch
            if x.kind is NodeKind.RECV:
                assert ins[i + 1].kind is NodeKind.COMPUTE
                assert ins[i + 1].microbatch == x.microbatch


def test_instruction_fields_and_events() -> None:
    graph = pipeline_graph(2, 2, "gpipe", batch=3, hidden=5)
    program = compile_program(graph)
    r0 = {i.id: i for i in program.ranks[0].instructions}
    r1 = {i.id: i for i in program.ranks[1].instructions}
    send = r0["send.v:s0.mb1.0-1"]
    assert (send.peer, send.communicator, send.stream) == (1, "pp.fwd", "pp")
    assert send.meta == TensorMeta((3, 5), "float32", batch_dim=0, requires_grad=True)
    assert send.waits == ("ev.F.s0.mb1",) and r0["F.s0.mb1"].record == "ev.F.s0.mb1"
    recv = r1["recv.v:s0.mb1.0-1"]
    assert (recv.peer, recv.communicator, recv.record) == (0, "pp.fwd", "ev.recv.v:s0.mb1.0-1")
    assert r1["F.s1.mb1"].waits == ("ev.recv.v:s0.mb1.0-1",)
    grad = r1["send.grad:v:s0.mb0.1-0"]
    assert (grad.peer, grad.communicator) == (0, "pp.bwd")
    assert r1["B.s1.mb0"].record == "ev.B.s1.mb0"
    assert r1["F.loss.mb0"].waits == ()  # same stream as its producer: no event


def test_program_metadata() -> None:
    graph = pipeline_graph(3, 2, "1f1b")
    program = compile_program(graph)
    assert program.world_size == 3
    assert [(c.id, c.ranks) for c in program.communicators] == [("pp.fwd", (0, 1, 2)), ("pp.bwd", (0, 1, 2))]
    assert dict(program.placement) == {"s0": (0,), "s1": (1,), "s2": (2,), "loss": (2,)}
    assert (program.segments, program.values) == (graph.segments, graph.values)
    assert (program.inputs, program.targets, program.microbatches) == (("input:0",), ("target:0",), 2)


def test_single_rank_has_no_communicators() -> None:
    program = compile_program(pipeline_graph(1, 2, "gpipe"))
    assert program.communicators == ()
    assert all(i.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER) for i in program.ranks[0].instructions)


def test_compile_is_deterministic_and_round_trips() -> None:
    graph = pipeline_graph(4, 5, "1f1b")
    a, b = compile_program(graph), compile_program(graph)
    assert a == b
    assert to_json(a) == to_json(b)
    back = from_json(to_json(a))
    assert back == a
    verify(back)


def _forward_graph(nodes: list[Node], edges: list[Edge], world_size: int, segments: list[str]) -> Graph:
    meta = TensorMeta((2, 4), "float32", batch_dim=0)
    segs = [Segment(s, SegmentRole.STAGE, Tags(), inputs=(), outputs=(f"v:{s}",)) for s in segments]
    values = [Value(f"v:{s}", meta) for s in segments]
    return Graph(segs, values, nodes, edges, microbatches=1, world_size=world_size)


def _f(seg: str, devices: tuple[int, ...]) -> Node:
    return Node(f"F.{seg}.mb0", NodeKind.COMPUTE, segment=seg, phase=Phase.F, microbatch=0, devices=devices)


def _p2p(value: str, src: int, dst: int) -> tuple[Node, Node]:
    common = dict(value=value, microbatch=0, stream="pp")
    return (
        Node(f"send.{value}.mb0.{src}-{dst}", NodeKind.SEND, devices=(src,), peers=(dst,), **common),
        Node(f"recv.{value}.mb0.{src}-{dst}", NodeKind.RECV, devices=(dst,), peers=(src,), **common),
    )


def test_receives_follow_the_senders_order() -> None:
    # Rank 0 produces v:a then v:b; rank 1 is ordered to consume v:b first. In-order matching
    # requires rank 1 to receive v:a first anyway, so compile pulls that receive forward.
    sa, ra = _p2p("v:a", 0, 1)
    sb, rb = _p2p("v:b", 0, 1)
    nodes = [_f("a", (0,)), _f("b", (0,)), _f("c", (1,)), _f("d", (1,)), sa, ra, sb, rb]
    edges = [
        Edge("F.a.mb0", sa.id, value="v:a"),
        Edge(sa.id, ra.id, value="v:a"),
        Edge(ra.id, "F.d.mb0", value="v:a"),
        Edge("F.b.mb0", sb.id, value="v:b"),
        Edge(sb.id, rb.id, value="v:b"),
        Edge(rb.id, "F.c.mb0", value="v:b"),
        Edge("F.a.mb0", "F.b.mb0", EdgeKind.TEMPORAL),
        Edge("F.c.mb0", "F.d.mb0", EdgeKind.TEMPORAL),
    ]
    program = compile_program(_forward_graph(nodes, edges, 2, ["a", "b", "c", "d"]))
    assert [i.id for i in program.ranks[1].instructions] == [ra.id, rb.id, "F.c.mb0", "F.d.mb0"]


def test_cross_rank_paths_order_local_nodes() -> None:
    # F.c (rank 0) must wait for F.b on rank 1, which needs F.a from rank 0: a path through two
    # SEND/RECV pairs orders F.a before F.c on rank 0 even though the tie-break prefers F.c.
    s1, r1 = _p2p("v:a", 0, 1)
    s2, r2 = _p2p("v:b", 1, 0)
    nodes = [_f("c", (0,)), _f("a", (0,)), _f("b", (1,)), s1, r1, s2, r2]
    edges = [
        Edge("F.a.mb0", s1.id, value="v:a"),
        Edge(s1.id, r1.id, value="v:a"),
        Edge(r1.id, "F.b.mb0", value="v:a"),
        Edge("F.b.mb0", s2.id, value="v:b"),
        Edge(s2.id, r2.id, value="v:b"),
        Edge(r2.id, "F.c.mb0", value="v:b"),
    ]
    program = compile_program(_forward_graph(nodes, edges, 2, ["c", "a", "b"]))
    assert [i.id for i in program.ranks[0].instructions] == ["F.a.mb0", s1.id, r2.id, "F.c.mb0"]


def test_replicated_node_appears_on_every_member() -> None:
    nodes = [_f("a", (0, 1))]
    program = compile_program(_forward_graph(nodes, [], 2, ["a"]))
    assert [i.id for i in program.ranks[0].instructions] == ["F.a.mb0"]
    assert program.ranks[0].instructions == program.ranks[1].instructions
    assert dict(program.placement) == {"a": (0, 1)}


def test_unplaced_graph_is_rejected() -> None:
    graph = _forward_graph([_f("a", ())], [], 0, ["a"])
    with pytest.raises(SchedulingError, match="not placed"):
        compile_program(graph)
    graph = _forward_graph([_f("a", ()), _f("b", (0,))], [], 1, ["a", "b"])
    with pytest.raises(SchedulingError, match="F.a.mb0 has no devices"):
        compile_program(graph)


def test_unsupported_node_kind_is_rejected() -> None:
    node = Node("a2a.0", NodeKind.ALL_TO_ALL, devices=(0, 1))
    with pytest.raises(SchedulingError, match="all_to_all is not supported"):
        compile_program(_forward_graph([_f("a", (0,)), node], [], 2, ["a"]))


def test_compile_scales_linearly_enough() -> None:
    graph = pipeline_graph(4, 64, "1f1b")  # ~1.5k nodes: a smoke check of the linear passes
    program = compile_program(graph)
    assert sum(len(p.instructions) for p in program.ranks) == len(graph.nodes)
