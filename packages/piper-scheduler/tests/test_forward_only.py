"""forward_only: the evaluation step of a training graph (docs/ir-conventions.md, section 11):
forwards, activation transfers and ZeRO-3 gathers only, orders kept, compiled on a subset of
the training program's communicators."""

from __future__ import annotations

import pytest

from piper_directives import build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_ir import NodeKind, Phase, is_grad, to_json
from piper_memory import add_grad_norm, plan_memory
from piper_scheduler import compile_program, forward_only, verify


def _planned(schedule: str, pp: int, mb: int, stages: int, **kw):
    graph = synthetic_graph(stages, mb, hidden=4, batch=kw.get("dp", 1))
    return plan_memory(build_schedule(schedule, pp, mb, stages=stages, **kw).apply(graph))


@pytest.mark.parametrize(
    ("schedule", "pp", "mb", "stages", "kw"),
    [
        ("1f1b", 2, 4, 2, {}),
        ("interleaved_1f1b", 2, 4, 4, {}),
        ("zb1p", 2, 4, 2, {}),
        ("dualpipev", 2, 4, 4, {"dp": 2, "zero": 3}),
        ("dualpipe", 2, 4, 2, {"dp": 2, "zero": 2}),
        ("1f1b", 2, 4, 2, {"dp": 2, "zero": 1}),
    ],
)
def test_only_the_forward_step_remains_and_compiles_on_the_training_communicators(schedule, pp, mb, stages, kw):
    training = add_grad_norm(_planned(schedule, pp, mb, stages, **kw), 1.0)
    graph = forward_only(training)
    assert graph.grad_norm is None
    kinds = {n.kind for n in graph.nodes}
    assert kinds <= {NodeKind.COMPUTE, NodeKind.SEND, NodeKind.RECV, NodeKind.MATERIALIZE, NodeKind.FREE}
    assert {n.phase for n in graph.nodes if n.kind is NodeKind.COMPUTE} == {Phase.F}
    assert not any(is_grad(n.value or "") for n in graph.nodes if n.kind in (NodeKind.SEND, NodeKind.RECV))
    # Every forward of every microbatch is still there, and every ZeRO-3 gather with its free.
    forwards = {n.id for n in training.nodes if n.kind is NodeKind.COMPUTE and n.phase is Phase.F}
    assert {n.id for n in graph.nodes if n.kind is NodeKind.COMPUTE} == forwards
    gathers = {n.id for n in training.nodes if n.kind in (NodeKind.MATERIALIZE, NodeKind.FREE)}
    assert {n.id for n in graph.nodes if n.kind in (NodeKind.MATERIALIZE, NodeKind.FREE)} == gathers
    program, trained = compile_program(graph), compile_program(training)
    verify(program)
    assert {c.id: c for c in program.communicators}.items() <= {c.id: c for c in trained.communicators}.items()
    assert [p.replica for p in program.ranks] == [p.replica for p in trained.ranks]
    # The pass and compile are deterministic.
    assert to_json(compile_program(forward_only(training))) == to_json(program)


def test_the_schedule_order_of_forwards_and_chains_survives():
    """1F1B with ZeRO-3 on rank 0: forwards in microbatch order, as the training plan runs
    them (interleaved with backwards there), each use inside a gather/free pair."""
    training = _planned("1f1b", 2, 4, 2, dp=2, zero=3)
    trained = compile_program(training)
    program = compile_program(forward_only(training))
    for rank in range(program.world_size):
        ours = [i.id for i in program.plan(rank).instructions if i.kind is NodeKind.COMPUTE]
        theirs = [i.id for i in trained.plan(rank).instructions if i.kind is NodeKind.COMPUTE and i.phase is Phase.F]
        assert ours == theirs
        live = False
        for ins in program.plan(rank).instructions:
            if ins.kind is NodeKind.MATERIALIZE:
                live = True
            elif ins.kind is NodeKind.FREE:
                live = False
            elif ins.kind is NodeKind.COMPUTE and ins.segment != "loss":
                assert live, f"rank {rank}: {ins.id} runs without its parameters gathered"
