"""``Strategy.phases``: run one by one, they give what ``apply`` gives; the collector is paused
while ``apply`` runs them. (That its work grows linearly with the graph is counted beside
compile's, in piper-scheduler's ``test_compile_scaling.py``.)"""

from __future__ import annotations

import gc

import pytest

from piper_directives import Place, Strategy, build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_ir import DirectiveError


def test_the_phases_one_by_one_give_what_apply_gives() -> None:
    graph = synthetic_graph(2, 4, 1, hidden=4)
    strategy = build_schedule("zb1p", 2, 4)
    stepped = graph
    names = []
    for name, phase in strategy.phases():
        names.append(name)
        stepped = phase(stepped)
    assert stepped == strategy.apply(graph)
    assert names == ["split", "recompute", "place", "shard", "context", "replicate", "context records",
                     "communication", "split backward", "order", "validate"]
    assert any(n.id.startswith("BW.") for n in stepped.nodes)  # zb1p split its backwards


def test_phases_check_the_directives_before_any_phase_runs() -> None:
    strategy = build_schedule("1f1b", 2, 4)
    no_place = Strategy(tuple(d for d in strategy.directives if not isinstance(d, Place)))
    with pytest.raises(DirectiveError, match="at least one Place"):
        no_place.phases()


def test_the_collector_is_paused_while_a_strategy_applies_and_restored_after(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = synthetic_graph(2, 2, 1, hidden=4)
    strategy = build_schedule("1f1b", 2, 2)
    states = []
    phases = strategy.phases()
    spy = ("spy", lambda g: (states.append(gc.isenabled()), g)[1])
    monkeypatch.setattr(Strategy, "phases", lambda self: [spy, *phases])
    try:
        assert gc.isenabled()
        strategy.apply(graph)
        assert states == [False] and gc.isenabled()
        gc.disable()
        strategy.apply(graph)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
