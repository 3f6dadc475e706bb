"""DualPipeV's overlapped F&B slots in the simulator: ``CostModel.FB``, the pair models and
the bubble.

DeepSeek's DualPipe table gives DualPipeV (PP stages on PP/2 ranks) a bubble of
``(PP/2-1)(F&B+B-3W)`` and ``PP+1`` stages of activations, for B = F+W, W <= F and
max(F,B) <= F&B <= F+B. A compiled slot receives both chunks' inputs before its first
instruction and sends each chunk's output after it. ``CostModel(pairs="halves")`` (the default)
lets neither half of a pair publish its output earlier than it would alone from the pair's
start, and holds the rank for F&B; its bubble (max over ranks of makespan - busy, busy counting
each pair as F&B) is ``(PP/2-1)(2B-3W)``: the table's formula at F&B = B, below it otherwise,
and independent of F&B. ``pairs="atomic"`` (a pair starts with all its inputs in and publishes
everything at its end, as DeepSeek's implementation sends after the overlapped compute) gives
the table's formula exactly. docs/schedules.md derives both. Plans come from the synthetic
graph (no torch).

DualPipe (PP stages on PP ranks, two directions of M/2 microbatches each) runs on every rank
the eight phases DualPipeV runs on rank ``min(r, PP-1-r)`` of PP/2 ranks with M/2
microbatches, and its mirror ranks run mirror-image programs, so with free communication its
timeline is DualPipeV's: the same closed forms with PP the number of ranks, and PP+1 units of
peak activations. The mirror pairs' gradient all-reduces (``plan_memory``) come after both
ranks' last weight pass, which the two reach at the same time, so they add no idle time.
"""

from __future__ import annotations

import pytest

from piper_directives import Place, Split, Strategy, build_schedule, rank_actions
from piper_directives.order import Order
from piper_directives.synthetic import synthetic_graph
from piper_ir import NodeKind, Phase, from_json, to_json
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


def _costs(f: float, w: float, fb: float | None, pairs: str = "halves") -> CostModel:
    return CostModel(F=f, B=f + w, BI=f, BW=w, FB=fb, overrides=FREE_LOSS, pairs=pairs)


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
    """Max idle over ranks is ``(PP/2-1)(2B-3W)`` with halves, never above the table's
    ``(PP/2-1)(F&B+B-3W)`` and equal to it at F&B = B; with atomic pairs it is the table's;
    peak activations PP+1 on every rank."""
    for f, w in COSTS:
        b = f + w
        assert w <= f
        for fb in (max(f, b), (b + f + b) / 2, f + b):  # max(F,B) <= F&B <= F+B
            table = (stages // 2 - 1) * (fb + b - 3 * w)
            halves = simulate(program, _costs(f, w, fb))
            assert max(halves.idle) == pytest.approx((stages // 2 - 1) * (2 * b - 3 * w)), (f, w, fb)
            assert max(halves.idle) <= table + 1e-9
            if fb == max(f, b):  # the table's own formula, exactly
                assert max(halves.idle) == pytest.approx(table)
            atomic = simulate(program, _costs(f, w, fb, "atomic"))
            assert max(atomic.idle) == pytest.approx(table), (f, w, fb)
            assert atomic.busy == pytest.approx(halves.busy)  # both charge a pair F&B
            assert list(halves.peak_memory) == [stages + 1] * program.world_size


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


def _pairs(program) -> dict[tuple[int, int], list[int]]:
    out: dict[tuple[int, int], list[int]] = {}
    for plan in program.ranks:
        for i, ins in enumerate(plan.instructions):
            if ins.overlap is not None:
                out.setdefault((plan.rank, ins.overlap), []).append(i)
    return out


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (3, 6), (4, 20)])
def test_a_slot_receives_all_its_inputs_before_it_starts(ranks, microbatches):
    """The receives a slot's members need come before its first member, so the backward
    half's input never queues behind the forward half's send on the pp stream."""
    _, program = _dualpipev(ranks, microbatches)
    for (rank, _), members in _pairs(program).items():
        plan = program.ranks[rank].instructions
        waited = {ev for i in members for ev in plan[i].waits}
        recvs = [j for j, ins in enumerate(plan) if ins.kind is NodeKind.RECV and ins.record in waited]
        assert all(j < members[0] for j in recvs)
    assert any(ins.kind is NodeKind.RECV for plan in program.ranks for ins in plan.instructions)


@pytest.mark.parametrize("fb", [2.0, 2.5, 3.0])
def test_no_half_publishes_before_it_would_alone(fb):
    """With F&B < F+B each instruction of a pair is charged less, but what waits on the forward
    half (its send) starts no earlier than the pair's start + F, what waits on the backward half
    no earlier than start + B, and the rank's next instruction after both halves are done."""
    _, program = _dualpipev(3, 12)
    f, w = 1.0, 1.0
    costs = _costs(f, w, fb)
    timeline = simulate(program, costs)
    span = {(iv.rank, iv.instruction): (iv.start, iv.end) for iv in timeline.intervals}
    for (rank, _), members in _pairs(program).items():
        plan = program.ranks[rank].instructions
        t0 = min(span[(rank, plan[i].id)][0] for i in members)
        charged = sum(costs.compute_cost(plan[i].segment, plan[i].phase) for i in members) * costs.overlap_factor()
        assert sum(span[(rank, plan[i].id)][1] - span[(rank, plan[i].id)][0] for i in members) == pytest.approx(charged)
        alone = {Phase.F: 0.0, Phase.B: 0.0}
        for i in members:
            half = Phase.F if plan[i].phase is Phase.F else Phase.B
            alone[half] += costs.compute_cost(plan[i].segment, plan[i].phase)
            for ins in plan:
                if plan[i].record is not None and plan[i].record in ins.waits:
                    assert span[(rank, ins.id)][0] >= t0 + alone[half] - 1e-9
        later = [span[(rank, ins.id)][0] for ins in plan[members[-1] + 1 :] if ins.stream == plan[members[-1]].stream]
        if later:
            assert min(later) >= t0 + max(alone.values()) - 1e-9


def test_a_slot_whose_backward_needs_its_forward_still_compiles():
    """Receiving up front would deadlock a slot holding a chunk's forward and its own backward;
    compile then receives before each member, as for any other compute."""
    def stage(pp: int, phase: str, mb: int) -> dict:
        return {"PP": pp, "PASS": phase, "MB": mb}

    def loss(phase: str, mb: int) -> dict:
        return {"SEG": "loss", "PASS": phase, "MB": mb}

    strategy = Strategy([
        Split(2), Place({"PP": 0}, 0), Place({"PP": 1}, 1),
        Order([[stage(0, "F", 0), stage(0, "B", 0)], [stage(0, "F", 1)], [stage(0, "B", 1)]]),
        Order([[stage(1, "F", 0), loss("F", 0)], [loss("B", 0), stage(1, "B", 0)],
               [stage(1, "F", 1), loss("F", 1)], [loss("B", 1), stage(1, "B", 1)]]),
    ])
    program = compile_program(strategy.apply(synthetic_graph(2, 2, 1, hidden=4)))
    labels = [ins.short() for ins in program.ranks[0].instructions]
    assert labels.index("SEND v:s0#0 ->1") < labels.index("RECV grad:v:s0#0 <-1") < labels.index("s0:B0")
    assert {ins.overlap for ins in program.ranks[0].instructions if ins.phase in (Phase.F, Phase.B)} >= {0}
    assert simulate(program, _costs(1.0, 1.0, 2.5)).makespan > 0


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 8), (3, 12), (5, 20)])
def test_critical_paths_of_the_derivation(ranks, microbatches):
    """docs/schedules.md's derivation, step by step: the tip (rank n-1) is the least busy rank
    and ends its last pair at T = (n-1)F + busy - n(B + BI + W); after T the halves model runs
    the tip's cooldown, n(B + BI), then (n-1) BI and one W, the atomic model n-1 pairs, B,
    2n-1 BI and one W."""
    _, program = _dualpipev(ranks, microbatches)
    n, (f, w, fb) = ranks, (1.5, 1.0, 3.0)
    b, bi = f + w, f
    for pairs, after in (("halves", n * b + n * bi + (n - 1) * bi + w), ("atomic", (n - 1) * fb + b + (2 * n - 1) * bi + w)):
        timeline = simulate(program, _costs(f, w, fb, pairs))
        busy = timeline.busy[n - 1]
        assert busy == pytest.approx(min(timeline.busy))
        t = (n - 1) * f + busy - n * (b + bi + w)
        assert max(iv.end for iv in timeline.of_rank(n - 1) if iv.overlap is not None) == pytest.approx(t)
        assert timeline.makespan == pytest.approx(t + after)
