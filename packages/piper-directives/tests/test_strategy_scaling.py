"""``Strategy.apply``'s work grows linearly with the graph (counted, not timed); its phases,
run one by one, give what ``apply`` gives; the collector is paused while it runs."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import pytest

from piper_directives import build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_ir import DirectiveError


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


@pytest.mark.parametrize("schedule", ["1f1b", "zb1p"])
def test_apply_work_grows_linearly_with_the_pipeline(schedule: str) -> None:
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


def test_the_phases_one_by_one_give_what_apply_gives() -> None:
    graph = synthetic_graph(2, 4, 1, hidden=4)
    strategy = build_schedule("zb1p", 2, 4)
    stepped = graph
    names = []
    for name, phase in strategy.phases():
        names.append(name)
        stepped = phase(stepped)
    assert stepped == strategy.apply(graph)
    assert names == ["split", "recompute", "place", "shard", "replicate", "communication", "split backward",
                     "order", "validate"]
    assert any(n.id.startswith("BW.") for n in stepped.nodes)  # zb1p split its backwards


def test_phases_check_the_directives_before_any_phase_runs() -> None:
    strategy = build_schedule("1f1b", 2, 4)
    no_place = type(strategy)(tuple(d for d in strategy.directives if type(d).__name__ != "Place"))
    with pytest.raises(DirectiveError, match="at least one Place"):
        no_place.phases()


def test_the_collector_is_paused_while_a_strategy_applies_and_restored_after() -> None:
    graph = synthetic_graph(2, 2, 1, hidden=4)
    strategy = build_schedule("1f1b", 2, 2)
    states = []
    phases = strategy.phases()
    spy = type(strategy).phases
    try:
        type(strategy).phases = lambda self: [("spy", lambda g: (states.append(gc.isenabled()), g)[1]), *phases]
        assert gc.isenabled()
        strategy.apply(graph)
        assert states == [False] and gc.isenabled()
        gc.disable()
        strategy.apply(graph)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        type(strategy).phases = spy
        gc.enable()
