"""``HappensBefore``: one stream's order, a waited event, and chains of both; the clocks are
made only for a question the two instructions alone do not answer."""

from __future__ import annotations

import itertools

from piper_ir import Instruction, NodeKind, RankPlan
from piper_scheduler import happens_before
from piper_scheduler.happens_before import HappensBefore

# stream, waits, record of each instruction: x on A; y on B after x's event; z on C after
# y's; w on B after y; v on A, which nothing waits for
STEPS = [("A", (), "ev.x"), ("B", ("ev.x",), "ev.y"), ("C", ("ev.y",), None), ("B", (), None), ("A", (), None)]
PLAN = RankPlan(0, [Instruction(f"i{k}", NodeKind.COMPUTE, stream, waits=waits, record=record)
                    for k, (stream, waits, record) in enumerate(STEPS)])
PRECEDES = {(0, 1), (0, 2), (0, 3), (0, 4), (1, 2), (1, 3)}
CLOCKS = happens_before._clocks


def test_every_pair_is_answered_as_the_chains_say() -> None:
    order = HappensBefore(PLAN)
    for a, b in itertools.product(range(len(STEPS)), repeat=2):
        assert order.precedes(a, b) == ((a, b) in PRECEDES), (a, b)


def test_the_clocks_wait_for_a_question_the_pair_does_not_answer(monkeypatch) -> None:
    made = []
    monkeypatch.setattr(happens_before, "_clocks", lambda plan: made.append(plan) or CLOCKS(plan))
    order = HappensBefore(PLAN)
    assert order.precedes(0, 4) and order.precedes(0, 1) and not order.precedes(4, 0)  # one stream; a wait
    assert not made
    assert order.precedes(0, 2) and order.precedes(0, 3) and not order.precedes(2, 3)  # chains
    assert len(made) == 1
