"""add_grad_norm on real models whose tensor- and expert-parallel parameters are cut by the
torch-side rewrite (``shard_modules``): every gradient element counted exactly once over the
world (docs/ir-conventions.md, section 10), the copies that tensor parallelism replicates
(LayerNorms, biases added after the all-reduce) once per model, cut pieces on every rank.
No processes: graphs and programs only. The synthetic cases are in piper-memory's tests."""

from __future__ import annotations

import pytest

from piper_directives import build_schedule, capture, shard_modules
from piper_ir import Graph, NodeKind, NormTerm
from piper_memory import add_grad_norm, plan_memory
from piper_scheduler import compile_program
from piper_train.models import build_model

CASES = [
    ("transformer", "1f1b", 2, 4, 2, {"tp": 2}),
    ("transformer", "dualpipev", 2, 4, 4, {"tp": 2}),
    ("transformer", "1f1b", 1, 2, 2, {"tp": 2, "dp": 2, "zero": 1}),
    ("transformer", "1f1b", 1, 2, 2, {"tp": 2, "dp": 2, "zero": 3}),
    ("moe", "1f1b", 2, 2, 2, {"ep": 2}),
    ("moe", "1f1b", 1, 2, 2, {"ep": 2, "dp": 2, "zero": 2}),
]


def _planned(name: str, schedule: str, pp: int, mb: int, stages: int, kw: dict) -> tuple[Graph, int]:
    """The planned graph of a model under a strategy, and the model's parameter count."""
    workload = build_model(name, stages=stages)
    captured = capture(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn)
    graph, _ = shard_modules(build_schedule(schedule, pp, mb, stages=stages, **kw).apply(captured.graph), captured.modules)
    return plan_memory(graph), sum(p.numel() for p in workload.model.parameters())


def _elements(graph: Graph, term: NormTerm) -> int:
    """How many gradient elements ``term`` counts (a rank's piece of a cut parameter)."""
    if term.bucket is not None:
        return sum(b - a for a, b in term.ranges)
    meta = dict(graph.segment_by_id[term.segment].params)[term.param]
    sharding = {s.segment: s for s in graph.sharding}.get(term.segment)
    return (sharding.local_meta(term.param, meta) if sharding else meta).numel()


@pytest.mark.parametrize(("name", "schedule", "pp", "mb", "stages", "kw"), CASES)
def test_every_gradient_element_is_counted_once(name, schedule, pp, mb, stages, kw) -> None:
    planned, numel = _planned(name, schedule, pp, mb, stages, kw)
    graph = add_grad_norm(planned, 1.0)
    terms = graph.grad_norm.terms
    assert sum(_elements(graph, t) for t in terms) == numel
    keys = [(t.rank, t.param or t.bucket) for t in terms]
    assert len(keys) == len(set(keys))
    program = compile_program(graph)
    assert all(sum(i.kind is NodeKind.GRAD_NORM for i in p.instructions) == 1 for p in program.ranks)


def test_a_tensor_parallel_copy_counts_once_and_a_cut_piece_everywhere() -> None:
    pure, _ = _planned("transformer", "1f1b", 2, 4, 2, {"tp": 2})  # stage 0 on (0, 1), stage 1 on (2, 3)
    terms = add_grad_norm(pure).grad_norm.terms
    ln = [t for t in terms if t.param and ".ln1." in t.param]
    assert ln and {t.rank for t in ln} == {0, 2}  # the first rank of each TP group
    qkv = [t for t in terms if t.param and t.param.endswith("attn.qkv.weight")]
    assert sorted(t.rank for t in qkv) == [0, 1, 2, 3]
    # DP=2 x TP=2, ZeRO-1: both positions' buckets count (their cut weights), and position 1's
    # ranges leave its LayerNorm copies out, so they cover fewer elements than position 0's.
    planned, _ = _planned("transformer", "1f1b", 1, 2, 2, {"tp": 2, "dp": 2, "zero": 1})
    graph = add_grad_norm(planned)
    per_position = {0: 0, 1: 0}
    for t in graph.grad_norm.terms:
        per_position[int(t.bucket.split(":tp")[1][0])] += sum(b - a for a, b in t.ranges)
    assert 0 < per_position[1] < per_position[0]
