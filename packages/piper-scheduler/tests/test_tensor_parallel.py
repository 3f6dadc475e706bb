"""Compiling and verifying tensor-parallel plans (``Shard``), without torch work."""

from __future__ import annotations

import attrs
import pytest

from piper_directives import one_f_one_b, tensor_parallel
from piper_directives.synthetic import synthetic_graph
from piper_ir import DeadlockError, NodeKind, Program, from_json, to_json
from piper_scheduler import compile_program, simulate, verify


def _program() -> Program:
    graph = tensor_parallel(one_f_one_b(2, 4), 2).apply(synthetic_graph(2, 4, 1, hidden=16, batch=1))
    # shard_modules (torch side) fills in what the segment code issues; pretend one all-reduce.
    sharding = tuple(attrs.evolve(sh, collectives=0 if sh.segment == "loss" else 1) for sh in graph.sharding)
    return compile_program(attrs.evolve(graph, sharding=sharding))


def test_tp_groups_get_a_communicator_and_share_one_replica_index() -> None:
    program = _program()
    tp = {c.id: c.ranks for c in program.communicators if c.traffic == "tp"}
    assert tp == {"tp:0-1": (0, 1), "tp:2-3": (2, 3)}
    assert program.replicas == 1 and [p.replica for p in program.ranks] == [0, 0, 0, 0]
    for plan in program.ranks:
        for ins in plan.instructions:
            if ins.kind is NodeKind.COMPUTE:
                want = None if ins.segment == "loss" else f"tp:{'-'.join(map(str, (plan.rank // 2 * 2, plan.rank // 2 * 2 + 1)))}"
                assert ins.communicator == want, ins
    assert from_json(to_json(program)) == program
    assert simulate(program).makespan > 0


def test_tp_members_must_run_their_compute_in_one_order() -> None:
    program = _program()
    plan = program.ranks[1]
    # Events dropped so that only the collective order is wrong.
    ins = [attrs.evolve(x, waits=(), record=None) for x in plan.instructions]
    i, j = [
        k for k, x in enumerate(ins) if x.kind is NodeKind.COMPUTE and x.communicator
    ][:2]
    ins[i], ins[j] = ins[j], ins[i]
    broken = attrs.evolve(program, ranks=(program.ranks[0], attrs.evolve(plan, instructions=ins), *program.ranks[2:]))
    with pytest.raises(DeadlockError, match="communicator 'tp:0-1': collective 0 differs between members"):
        verify(broken)
