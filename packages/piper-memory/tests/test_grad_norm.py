"""add_grad_norm: one GRAD_NORM node after every reduction and before every optimizer step,
and terms that count every gradient element of the model exactly once over the world
(docs/ir-conventions.md, section 10), for pipelines, data parallelism at every ZeRO level,
DualPipe's mirrors (synthetic models; tensor and expert parallelism, whose cut parameters
come from the torch-side rewrite, are in integration/test_grad_norm_terms.py)."""

from __future__ import annotations

import pytest

from piper_directives import build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_ir import (
    EdgeKind,
    Graph,
    MemoryPlanError,
    NodeKind,
    NormTerm,
    Residency,
    from_json,
    to_json,
)
from piper_memory import add_grad_norm, plan_memory
from piper_scheduler import compile_program

HIDDEN = 5  # weight 25 + bias 5 per segment: buckets of 30 elements, padded when sharded 4 ways
CASES = [
    ("1f1b", 2, 4, 2, {}),
    ("dualpipev", 2, 4, 4, {}),
    ("gpipe", 1, 2, 3, {"dp": 4, "zero": 1}),
    *(("1f1b", 2, 4, 2, {"dp": 2, "zero": z}) for z in (0, 1, 2, 3)),
    *(("dualpipe", 2, 4, 2, {"dp": 2, "zero": z}) for z in (0, 1, 2, 3)),
]


def _planned(schedule: str, pp: int, mb: int, stages: int, kw: dict) -> tuple[Graph, int]:
    """The planned graph of a synthetic model under a strategy, and its parameter count."""
    graph = synthetic_graph(stages, mb, hidden=HIDDEN, batch=kw.get("dp", 1))
    numel = sum(meta.numel() for seg in graph.segments for _, meta in seg.params)
    return plan_memory(build_schedule(schedule, pp, mb, stages=stages, **kw).apply(graph)), numel


def _elements(graph: Graph, term: NormTerm) -> int:
    """How many gradient elements ``term`` counts."""
    if term.bucket is not None:
        return sum(b - a for a, b in term.ranges)
    return dict(graph.segment_by_id[term.segment].params)[term.param].numel()


@pytest.mark.parametrize(("schedule", "pp", "mb", "stages", "kw"), CASES)
def test_every_gradient_element_is_counted_once(schedule, pp, mb, stages, kw) -> None:
    planned, numel = _planned(schedule, pp, mb, stages, kw)
    graph = add_grad_norm(planned, 0.5)
    assert graph.grad_norm is not None and graph.grad_norm.max_norm == 0.5
    terms = graph.grad_norm.terms
    assert sum(_elements(graph, t) for t in terms) == numel
    # No piece is counted twice: a (rank, parameter) or (rank, bucket) appears once, and a
    # bucket shard is counted only where its optimizer state is sharded, by one mirror.
    keys = [(t.rank, t.param or t.bucket) for t in terms]
    assert len(keys) == len(set(keys))
    buckets = {b.id: b for b in graph.buckets}
    for t in terms:
        if t.bucket is not None:
            b = buckets[t.bucket]
            assert b.optimizer_home is Residency.SHARDED
            assert t.ranges and all(0 <= a < c <= b.shard_numel for a, c in t.ranges)
    counted = {t.bucket for t in terms if t.bucket}
    for b in graph.buckets:
        assert not (b.id in counted and set(b.mirrors) & counted), f"mirrors {b.id} and {b.mirrors} both counted"


@pytest.mark.parametrize(("schedule", "pp", "mb", "stages", "kw"), CASES)
def test_the_norm_runs_after_every_reduction_and_before_every_step(schedule, pp, mb, stages, kw) -> None:
    planned, _ = _planned(schedule, pp, mb, stages, kw)
    graph = add_grad_norm(planned)
    norm = graph.node("grad_norm")
    assert norm.kind is NodeKind.GRAD_NORM and norm.devices == tuple(range(graph.world_size))
    before = {e.src for e in graph.predecessors["grad_norm"]}
    for opt in (n for n in planned.nodes if n.kind is NodeKind.OPTIMIZER):
        assert {e.src for e in planned.predecessors[opt.id]} <= before
        assert any(e.src == "grad_norm" and e.kind is EdgeKind.DATA for e in graph.predecessors[opt.id])
    program = compile_program(graph)  # verified: one collective over the world, in one order
    assert program.grad_norm == graph.grad_norm
    comm = next(c for c in program.communicators if c.traffic == "norm")
    assert comm.ranks == tuple(range(program.world_size))
    for plan in program.ranks:
        kinds = [ins.kind for ins in plan.instructions]
        at = kinds.index(NodeKind.GRAD_NORM)
        assert kinds.count(NodeKind.GRAD_NORM) == 1 and plan.instructions[at].communicator == comm.id
        # Every reduction of the rank is listed before the norm, every optimizer step after it.
        assert not {NodeKind.ALL_REDUCE, NodeKind.REDUCE_SCATTER} & set(kinds[at:])
        assert NodeKind.OPTIMIZER not in kinds[:at]


def test_round_trip_and_refusals() -> None:
    planned, _ = _planned("1f1b", 2, 4, 2, {"dp": 2, "zero": 2})
    graph = add_grad_norm(planned, 1.0)
    assert from_json(to_json(graph)) == graph
    with pytest.raises(MemoryPlanError, match="already has a gradient norm"):
        add_grad_norm(graph)
    with pytest.raises(MemoryPlanError, match="must be > 0"):
        add_grad_norm(planned, 0.0)
    unplanned = build_schedule("1f1b", 2, 4, stages=2, dp=2).apply(synthetic_graph(2, 4, hidden=HIDDEN, batch=2))
    with pytest.raises(MemoryPlanError, match="run plan_memory first"):
        add_grad_norm(unplanned)
    with pytest.raises(ValueError, match="a parameter or a bucket"):
        NormTerm(0, "s0")
