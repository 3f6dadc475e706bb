"""compile_program's and Strategy.apply's work grows linearly with the graph (counted, not
timed), and what compile does for speed (its own cycle check, the paused collector) changes
no result and no error."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import attrs
import pytest

from piper_directives import build_schedule, one_f_one_b, tensor_parallel
from piper_directives.synthetic import synthetic_graph
from piper_ir import Edge, EdgeKind, Graph, ValidationError, gc_paused, validate
from piper_memory import plan_memory
from piper_scheduler import compile_program


def _lines(fn: Callable[[], object]) -> int:
    """Python lines executed by ``fn()``: a machine-independent measure of its work."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    old = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local)
    try:
        fn()
    finally:
        sys.settrace(old)
    return count


def _zero3(pp: int) -> Graph:
    # Buckets grow with the segments, bucket operations with segments x microbatches.
    return plan_memory(build_schedule("1f1b", pp, 2, dp=2, zero=3).apply(synthetic_graph(pp, 2, 4, hidden=8, batch=2)))


def _tensor_parallel(pp: int) -> Graph:
    graph = tensor_parallel(one_f_one_b(pp, 2), 2).apply(synthetic_graph(pp, 2, 4, hidden=16, batch=1))
    sharding = tuple(attrs.evolve(sh, collectives=0 if sh.segment == "loss" else 1) for sh in graph.sharding)
    return attrs.evolve(graph, sharding=sharding)


@pytest.mark.parametrize("make", [_zero3, _tensor_parallel], ids=["dp2-zero3", "tp2"])
def test_compile_work_grows_linearly_with_the_graph(make: Callable[[int], Graph]) -> None:
    """Four times the pipeline ranks (and segments, buckets, shardings, channels): about four
    times the graph and four times the lines executed. A lookup that scanned every bucket or
    sharding per node, or every channel per rank, made it 4.8 times."""
    small, large = make(4), make(16)
    size = (len(large.nodes) + len(large.edges)) / (len(small.nodes) + len(small.edges))
    work = _lines(lambda: compile_program(large)) / _lines(lambda: compile_program(small))
    assert 3.5 < size < 4.5
    assert work < 1.1 * size, (work, size)


@pytest.mark.parametrize("schedule", ["1f1b", "zb1p"])
def test_strategy_apply_work_grows_linearly_with_the_pipeline(schedule: str) -> None:
    """Four times the pipeline ranks at the same microbatches: 3.7 times the graph and 3.8-3.9
    times the lines. Looking for the backwards an Order splits among every stage's backward
    of a microbatch, for every backward slot of every rank (ranks squared), made it 4.5
    (1F1B) and 4.8 (ZB1P) times."""
    def applied(pp: int) -> tuple[Callable[[], object], int]:
        graph = synthetic_graph(pp, 16, 1, hidden=8, batch=1)
        strategy = build_schedule(schedule, pp, 16)
        return (lambda: strategy.apply(graph)), len(graph.nodes) + len(graph.edges)

    (small, small_size), (large, large_size) = applied(4), applied(16)
    size = large_size / small_size
    work = _lines(large) / _lines(small)
    assert 3.5 < size < 4.5
    assert work < 1.12 * size, (work, size)


def test_a_cycle_is_the_error_validate_raises() -> None:
    graph = build_schedule("1f1b", 2, 4).apply(synthetic_graph(2, 4, 1, hidden=4))
    ids = [n.id for n in graph.nodes]
    cyclic = attrs.evolve(graph, edges=(*graph.edges, Edge(ids[-1], ids[0], EdgeKind.TEMPORAL, origin="test")))
    with pytest.raises(ValidationError) as expected:
        validate(cyclic)
    with pytest.raises(ValidationError) as got:
        compile_program(cyclic)
    assert str(got.value) == str(expected.value)
    assert "the graph has a cycle" in str(got.value) and "test" in (got.value.directive or "")
    unplaced = attrs.evolve(cyclic, world_size=0)  # the cycle is still the first error
    with pytest.raises(ValidationError, match="the graph has a cycle"):
        compile_program(unplaced)


def test_the_collector_is_paused_during_a_compile_and_restored_after() -> None:
    seen = []
    graph = build_schedule("1f1b", 2, 2).apply(synthetic_graph(2, 2, 1, hidden=4))
    gc.callbacks.append(lambda phase, info: seen.append(phase))
    try:
        assert gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():  # nested: still paused inside, and after the inner one
                pass
            assert not gc.isenabled()
            gc.collect()  # an explicit collection still runs
        assert gc.isenabled()
        program = compile_program(graph)
        assert gc.isenabled() and program.world_size == 2
        with pytest.raises(ValidationError):
            compile_program(attrs.evolve(graph, edges=(*graph.edges, Edge("OPT.s0", "F.s0.mb0", EdgeKind.TEMPORAL))))
        assert gc.isenabled()
        gc.disable()
        compile_program(graph)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
        gc.callbacks.pop()
    assert "start" in seen
