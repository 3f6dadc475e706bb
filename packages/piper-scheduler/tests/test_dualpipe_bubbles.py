"""DualPipeV's overlapped F&B slots in the simulator: ``CostModel.FB`` and the bubble.

DeepSeek's DualPipe table gives DualPipeV (PP stages on PP/2 ranks) a bubble of
``(PP/2-1)(F&B+B-3W)`` and ``PP+1`` stages of activations, for B = F+W, W <= F and
max(F,B) <= F&B <= F+B. Piper's compiled plan runs the two halves of an overlapped slot one
after the other and sends the forward half's output as soon as that half ends (the compile
puts its send before the backward half's receive), so the pair is not the atomic unit the
table assumes. The true closed form of the simulated bubble (max over ranks of makespan -
busy, busy counting each pair as F&B) is ``(PP/2-1)(2B-3W)``: the table's formula at
F&B = B = max(F, B), below it otherwise, and independent of F&B. docs/schedules.md explains.
Plans come from the synthetic graph (no torch).

DualPipe (PP stages on PP ranks, two directions of M/2 microbatches each) runs on every rank
the eight phases DualPipeV runs on rank ``min(r, PP-1-r)`` of PP/2 ranks with M/2
microbatches, and its mirror ranks run mirror-image programs, so with free communication its
timeline is DualPipeV's: the same closed form ``(PP/2-1)(2B-3W)`` with PP the number of ranks,
the table's formula at F&B = B, and PP+1 units of peak activations. The mirror pairs'
gradient all-reduces (``plan_memory``) come after both ranks' last weight pass, which the two
reach at the same time, so they add no idle time.
"""

from __future__ import annotations

import pytest

from piper_directives import build_schedule, rank_actions
from piper_directives.order import Order
from piper_directives.synthetic import synthetic_graph
from piper_ir import NodeKind, from_json, to_json
from piper_memory import plan_memory
from piper_scheduler import CostModel, compile_program, simulate

FREE_LOSS = {"loss": {"F": 0, "B": 0, "BI": 0, "BW": 0}}
_PROGRAMS: dict[tuple, object] = {}


def _dualpipev(ranks: int, microbatches: int):
    if (ranks, microbatches) not in _PROGRAMS:
        strategy = build_schedule("dualpipev", ranks, microbatches)
        graph = synthetic_graph(2 * ranks, microbatches, 1, hidden=4)
        _PROGRAMS[(ranks, microbatches)] = (strategy, compile_program(strategy.apply(graph)))
    return _PROGRAMS[(ranks, microbatches)]


def _dualpipe(ranks: int, microbatches: int):
    key = ("dualpipe", ranks, microbatches)
    if key not in _PROGRAMS:
        graph = build_schedule("dualpipe", ranks, microbatches).apply(synthetic_graph(ranks, microbatches, 1, hidden=4))
        _PROGRAMS[key] = compile_program(plan_memory(graph))
    return _PROGRAMS[key]


def _costs(f: float, w: float, fb: float | None) -> CostModel:
    return CostModel(F=f, B=f + w, BI=f, BW=w, FB=fb, overrides=FREE_LOSS)


CASES = [(2, 4), (2, 7), (3, 6), (4, 8), (4, 20)]
# (F, W): B = F + W and W <= F, as the table assumes
COSTS = [(1, 1), (2, 1), (1, 0.5), (3, 1), (1.5, 1)]


@pytest.mark.parametrize(("ranks", "microbatches"), CASES)
def test_compile_marks_the_overlapped_slots(ranks, microbatches):
    strategy, program = _dualpipev(ranks, microbatches)
    orders = [d for d in strategy.directives if isinstance(d, Order)]
    for plan, order in zip(program.ranks, orders, strict=True):
        pairs = [a for a in rank_actions(order) if a.startswith("(")]
        groups: dict[int, list] = {}
        for ins in plan.instructions:
            if ins.overlap is not None:
                assert ins.kind is NodeKind.COMPUTE
                groups.setdefault(ins.overlap, []).append(ins)
        assert sorted(groups) == list(range(len(pairs)))
        for members in groups.values():
            stage = [i for i in members if i.segment != "loss"]
            assert sorted(i.phase.value for i in stage) == ["B", "F"]
            assert stage[0].microbatch != stage[1].microbatch or stage[0].segment != stage[1].segment


def test_other_schedules_have_no_overlapped_slots():
    for name, pp, m in [("1f1b", 2, 4), ("zb1p", 3, 4), ("interleaved_1f1b", 2, 4), ("gpipe", 2, 2)]:
        strategy = build_schedule(name, pp, m)
        regions = 2 * pp if name == "interleaved_1f1b" else pp
        program = compile_program(strategy.apply(synthetic_graph(regions, m, 1, hidden=4)))
        assert all(ins.overlap is None for plan in program.ranks for ins in plan.instructions)


def test_program_json_keeps_overlap_and_old_documents_load():
    _, program = _dualpipev(2, 4)
    assert from_json(to_json(program)) == program
    old = to_json(program).replace('"overlap": null, ', "").replace(', "overlap": null', "")
    assert '"overlap": null' not in old
    assert from_json(old).ranks[0].instructions[0].overlap is None


@pytest.mark.parametrize(("ranks", "microbatches"), CASES)
def test_fb_charges_each_pair_fb(ranks, microbatches):
    """busy = all compute at full cost minus (F + B - F&B) per overlapped pair."""
    _, program = _dualpipev(ranks, microbatches)
    f, w = 2.0, 1.0
    b = f + w
    plain = simulate(program, _costs(f, w, None))
    assert simulate(program, _costs(f, w, f + b)) == plain  # F&B = F+B: no saving
    for fb in (b, 4.0):
        timeline = simulate(program, _costs(f, w, fb))
        for plan in program.ranks:
            pairs = len({i.overlap for i in plan.instructions if i.overlap is not None})
            assert timeline.busy[plan.rank] == pytest.approx(2 * microbatches * (f + b) - pairs * (f + b - fb))


@pytest.mark.parametrize(("ranks", "microbatches"), CASES)
def test_dualpipev_bubble_closed_form_and_memory(ranks, microbatches):
    _, program = _dualpipev(ranks, microbatches)
    _check_bubbles(program, 2 * ranks)  # PP in the table: two stages per rank


def _check_bubbles(program, stages: int) -> None:  # a Program
    """Max idle over ranks is ``(PP/2-1)(2B-3W)``, never above the table's
    ``(PP/2-1)(F&B+B-3W)`` and equal to it at F&B = B; peak activations PP+1 on every rank."""
    for f, w in COSTS:
        b = f + w
        assert w <= f
        for fb in (max(f, b), (b + f + b) / 2, f + b):  # max(F,B) <= F&B <= F+B
            timeline = simulate(program, _costs(f, w, fb))
            table = (stages // 2 - 1) * (fb + b - 3 * w)
            closed_form = (stages // 2 - 1) * (2 * b - 3 * w)
            assert max(timeline.idle) == pytest.approx(closed_form), (f, w, fb)
            assert max(timeline.idle) <= table + 1e-9
            if fb == max(f, b):  # the table's own formula, exactly
                assert max(timeline.idle) == pytest.approx(table)
            assert list(timeline.peak_memory) == [stages + 1] * program.world_size


DUALPIPE_CASES = [(2, 4), (2, 6), (4, 8), (4, 10), (4, 20), (6, 12), (8, 16)]


@pytest.mark.parametrize(("ranks", "microbatches"), DUALPIPE_CASES)
def test_dualpipe_bubble_closed_form_and_memory(ranks, microbatches):
    program = _dualpipe(ranks, microbatches)
    assert sum(ins.kind is NodeKind.ALL_REDUCE for plan in program.ranks for ins in plan.instructions) == 2 * ranks
    _check_bubbles(program, ranks)  # DualPipe runs PP stages on PP ranks


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (4, 8), (4, 12), (6, 12)])
def test_dualpipe_runs_dualpipev_timeline_on_half_the_ranks(ranks, microbatches):
    """Rank r of DualPipe is busy and idle exactly like rank min(r, PP-1-r) of DualPipeV over
    PP/2 ranks and M/2 microbatches (the same phases, mirrored)."""
    _, v_program = _dualpipev(ranks // 2, microbatches // 2)
    costs = _costs(2.0, 1.0, 3.5)
    mine, theirs = simulate(_dualpipe(ranks, microbatches), costs), simulate(v_program, costs)
    assert mine.makespan == pytest.approx(theirs.makespan)
    for r in range(ranks):
        h = min(r, ranks - 1 - r)
        assert mine.busy[r] == pytest.approx(theirs.busy[h]) and mine.idle[r] == pytest.approx(theirs.idle[h])
