"""The collectives a sharded segment issues inside its compute (tensor, sequence and context
parallelism, a vocabulary-parallel loss), priced from the IR on a ring link
(``costs.sharded_collectives``) and charged by the simulator (``CostModel.collectives``);
without torch work."""

from __future__ import annotations

import attrs
import pytest

from piper_directives import context_parallel, one_f_one_b, tensor_parallel
from piper_directives.synthetic import synthetic_graph
from piper_ir import NodeKind, ParamShard, Phase, Program
from piper_scheduler import CostModel, Link, compile_program, simulate
from piper_scheduler.costs import sharded_collectives

LINK = Link(bandwidth=1e4, latency=0.01)


def _program(kind: str, pp: int = 1, microbatches: int = 2, vocabulary: bool = True) -> Program:
    strategy = one_f_one_b(pp, microbatches)
    strategy = context_parallel(strategy, 2) if kind == "cp" else tensor_parallel(strategy, 2, sp=kind == "sp")
    graph = strategy.apply(synthetic_graph(pp, microbatches, 1, hidden=16, batch=2))
    # The torch-side rewrite fills in what each segment's code issues; pretend, under TP, a row Linear
    # (its weight cut on dimension 1) and with ``vocabulary`` a head cut by vocabulary whose loss issues
    # its all-reduce; under CP two gathers (keys and values).
    def filled(sh):
        if kind == "cp":
            return attrs.evolve(sh, collectives=0 if sh.segment == "loss" else 2)
        if sh.segment == "loss":
            return attrs.evolve(sh, collectives=int(vocabulary))
        return attrs.evolve(sh, params=(ParamShard("layers.0.weight", 1),), collectives=1 + int(vocabulary))
    return compile_program(attrs.evolve(graph, sharding=tuple(filled(sh) for sh in graph.sharding)))


def _stream(program: Program, segment: str) -> int:
    seg = program.segment_by_id[segment]
    return program.value_by_name[seg.inputs[0]].meta.nbytes()


@pytest.mark.parametrize("kind", ["tp", "sp", "cp"])
@pytest.mark.parametrize("vocabulary", [False, True])
def test_each_kinds_collectives_are_priced_from_the_ir_on_the_ring(kind, vocabulary):
    program = _program(kind, vocabulary=vocabulary)
    priced = sharded_collectives(program, LINK)
    stream = _stream(program, "s0")
    ar, ag = LINK.all_reduce(stream, 2), LINK.all_gather(stream, 2)
    head = int(vocabulary and kind != "cp")  # s0 is the head the vocabulary-parallel loss reads
    if kind == "cp":  # two gathers of keys/values whose whole is 2 chunks; as many reduce-scatters back
        forward = backward = 2 * LINK.all_gather(2 * stream, 2)
    elif kind == "tp":  # the row's all-reduce forward; its column's and the head's input's backward
        forward, backward = ar, ar + head * ar
    else:  # SP: the row's RS + AG; its output gathered unless it is the logits; the input re-gathered,
        # the head's input gathered (and reduce-scattered back); the input (no gradient) not
        forward, backward = ar + (1 - head) * ag + head * ag, ar + ag + head * ag
    assert priced["s0"] == pytest.approx({"F": forward, "B": backward, "BI": backward, "BW": 0.0})
    if kind == "cp" or not vocabulary:
        assert "loss" not in priced
    else:  # the vocabulary-parallel loss: per token two log-sum-exp slots and the target logit, fp32
        tokens = max(program.value_by_name[t].meta.numel() for t in program.targets)
        assert priced["loss"]["F"] == pytest.approx(LINK.all_reduce(3 * tokens * 4, 2))
        assert priced["loss"]["B"] == 0.0


def test_sequence_parallelism_moves_more_than_tensor_parallelism():
    """SP's reduce-scatter + all-gather in place of each all-reduce take the same ring time; its
    boundary gathers and the backward's second gather of a column's input are on top."""
    sp = sharded_collectives(_program("sp", vocabulary=False), LINK)
    tp = sharded_collectives(_program("tp", vocabulary=False), LINK)
    assert sp["s0"]["F"] > tp["s0"]["F"] and sp["s0"]["B"] > tp["s0"]["B"]


@pytest.mark.parametrize("kind", ["tp", "sp", "cp"])
def test_a_strategy_with_its_collectives_simulates_slower_by_what_they_cost(kind):
    """One stage: the rank's compute runs back to back, so the step grows by the collectives of
    every instruction it runs; each compute instruction lasts its compute plus its own."""
    program = _program(kind)
    priced = sharded_collectives(program, LINK)
    base = CostModel(F=1.0, B=2.0)
    charged = attrs.evolve(base, collectives=priced)
    plain, slower = simulate(program, base), simulate(program, charged)
    rank = program.ranks[0]
    extra = sum(priced.get(ins.segment, {}).get(ins.phase.value, 0.0)
                for ins in rank.instructions if ins.kind is NodeKind.COMPUTE)
    assert extra > 0
    assert slower.makespan == pytest.approx(plain.makespan + extra)
    assert charged.collective_cost("s0", Phase.F) == priced["s0"]["F"]
    assert charged.compute_cost("s0", Phase.F) == base.compute_cost("s0", Phase.F)  # compute itself unchanged


def test_collectives_are_free_without_a_group_or_a_link():
    program = _program("tp")
    assert all(v == 0 for costs in sharded_collectives(program, Link(bandwidth=float("inf"))).values()
               for v in costs.values())
    one = compile_program(one_f_one_b(1, 2).apply(synthetic_graph(1, 2, 1, hidden=16, batch=2)))
    assert sharded_collectives(one, LINK) == {}
