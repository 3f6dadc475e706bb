"""The strategy space of ``piper tune``: factorisations, stage bounds, and each candidate's
directive program (no torch, no Ray: a synthetic graph)."""

from __future__ import annotations

import itertools

import attrs
import pytest

from piper_directives import ContextParallel, Place, Shard, Strategy, build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_ir import DirectiveError, to_json
from piper_memory import plan_memory
from piper_scheduler import compile_program
from piper_train.tuning.space import (
    CHUNKS_PER_RANK,
    Candidate,
    balanced_bounds,
    enumerate_space,
    even_bounds,
    factorizations,
    variant_degrees,
)


def _program(strategy: Strategy, regions: int):
    return compile_program(plan_memory(strategy.apply(synthetic_graph(regions, 1, hidden=8, batch=8))))


@pytest.mark.parametrize("devices", [1, 2, 4, 6, 8])
def test_factorizations_cover_every_product_once(devices: int) -> None:
    found = factorizations(devices)
    assert len(set(found)) == len(found)
    assert all(pp * dp * tp * ep == devices and (tp == 1 or ep == 1) for pp, dp, tp, ep in found)
    brute = {(pp, dp, tp, ep) for pp, dp, tp, ep in itertools.product(range(1, devices + 1), repeat=4)
             if pp * dp * tp * ep == devices and (tp == 1 or ep == 1)}
    assert set(found) == brute
    assert {f for f in factorizations(devices, kinds=("tp",)) if f[3] > 1} == set()


def _brute_bounds(weights: list[float], chunks: int) -> float:
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), chunks - 1):
        b = (0, *cuts, n)
        best = min(best, max(sum(weights[i:j]) for i, j in zip(b, b[1:], strict=False)))
    return best


@pytest.mark.parametrize("weights", [[1, 1, 1, 1], [5, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7], [3, 1, 1, 1, 1, 4]])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_balanced_bounds_minimise_the_heaviest_stage(weights: list[float], chunks: int) -> None:
    bounds = balanced_bounds(weights, chunks)
    assert bounds is not None and bounds[0] == 0 and bounds[-1] == len(weights) and len(bounds) == chunks + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:], strict=False))  # no empty stage
    heaviest = max(sum(weights[i:j]) for i, j in zip(bounds, bounds[1:], strict=False))
    assert heaviest == pytest.approx(_brute_bounds(weights, chunks))


def test_no_bounds_for_more_stages_than_regions() -> None:
    assert balanced_bounds([1.0, 1.0], 3) is None
    assert even_bounds(6, 4) is None
    assert even_bounds(8, 4) == (0, 2, 4, 6, 8)


def test_enumeration_counts_and_rules() -> None:
    space = enumerate_space(4, 8, microbatches=[1, 2, 4])
    assert len(space) == len(set(space))
    assert all(c.devices == 4 for c in space)
    assert all(c.zero == 0 or c.dp > 1 or c.ep > 1 for c in space)  # ZeRO shards over replicas
    per_layout = {(c.schedule, c.pp, c.dp, c.tp, c.ep, c.zero, c.microbatches) for c in space}
    assert len(per_layout) == len(space)  # even split only: uniform weights add no balanced split
    uneven = enumerate_space(4, 8, microbatches=[2], weights=[4, 1, 1, 1, 1, 1, 1, 4])
    assert any(c.bounds is not None for c in uneven)
    assert len(uneven) > len(enumerate_space(4, 8, microbatches=[2]))


@pytest.mark.parametrize("schedule", sorted(CHUNKS_PER_RANK))
def test_even_candidate_is_the_library_schedule(schedule: str) -> None:
    """Without bounds a candidate compiles to exactly what build_schedule gives for the
    same regions, stage by stage."""
    regions, pp, m = 8, 2, 4
    chunks = pp * CHUNKS_PER_RANK[schedule]
    candidate = Candidate(schedule, pp, m)
    ours = _program(candidate.strategy(regions), regions)
    if chunks == regions:
        theirs = _program(build_schedule(schedule, pp, m, stages=regions), regions)
        assert to_json(ours) == to_json(theirs)
    assert ours.world_size == pp


def test_bounds_place_the_regions_asked_for() -> None:
    candidate = Candidate("1f1b", 2, 4, bounds=(0, 3, 8))
    strategy = candidate.strategy(8)
    places = {d.filter.as_dict()["PP"]: d.devices for d in strategy.of(Place)}
    assert places == {0: (0,), 1: (0,), 2: (0,), 3: (1,), 4: (1,), 5: (1,), 6: (1,), 7: (1,)}
    program = _program(strategy, 8)
    held = {r.rank: sorted(s for s in r.segments() if s != "loss") for r in program.ranks}
    assert held == {0: ["s0", "s1", "s2"], 1: ["s3", "s4", "s5", "s6", "s7"]}
    # uneven DualPipeV: a V over 4 schedule stages of 1, 2, 2, 3 regions, data-parallel
    v = Candidate("dualpipev", 2, 4, dp=2, zero=1, bounds=(0, 1, 3, 5, 8))
    assert _program(v.strategy(8), 8).world_size == 4


def test_json_round_trip_gives_the_same_program() -> None:
    candidate = Candidate("zb1p", 2, 4, dp=2, zero=2, bounds=(0, 3, 8))
    strategy = candidate.strategy(8)
    again = Strategy.from_json(strategy.to_json())
    assert again == strategy  # directives compare without where they were written
    ours, theirs = _program(again, 8), _program(strategy, 8)
    assert [p.instructions for p in ours.ranks] == [p.instructions for p in theirs.ranks]


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(DirectiveError, match="do not cut 8 regions into 2 non-empty stages"):
        Candidate("1f1b", 2, 4, bounds=(0, 3, 7)).strategy(8)
    with pytest.raises(DirectiveError, match="non-empty"):
        Candidate("1f1b", 2, 4, bounds=(0, 8, 8)).strategy(8)
    with pytest.raises(DirectiveError, match="cannot be spread evenly"):
        Candidate("1f1b", 4, 4).strategy(6)


def test_sequence_and_context_parallel_candidates() -> None:
    """``sp`` doubles each tp > 1 candidate (never one without tp), ``cps`` adds pp x dp x cp
    candidates (no tp/ep, no recomputation: the library refuses both with cp); each strategy
    is what parallelize/context_parallel build, and a variant names its profile."""
    base = enumerate_space(4, 8, microbatches=[2], schedules=["1f1b"], recompute=(False, True))
    space = enumerate_space(4, 8, microbatches=[2], schedules=["1f1b"], recompute=(False, True), sp=(False, True),
                            cps=(1, 2, 4))
    assert set(base) <= set(space) and len(space) == len(set(space))
    sp = [c for c in space if c.sp]
    assert sp and all(c.tp > 1 and not c.recompute for c in sp)
    assert {attrs.evolve(c, sp=False) for c in sp} == {c for c in base if c.tp > 1}
    cp = [c for c in space if c.cp > 1]
    assert {(c.pp, c.dp, c.cp) for c in cp} == {(1, 2, 2), (2, 1, 2), (1, 1, 4)}
    assert all(c.tp == c.ep == 1 and not c.recompute and c.devices == 4 for c in cp)
    assert all(c.zero == 0 or c.dp > 1 for c in cp)
    for c in (*sp, *cp):
        assert variant_degrees(c.variant) == (c.tp, c.ep, c.cp, c.sp)
        directives = c.strategy(8).directives
        if c.cp > 1:
            groups = [d for d in directives if isinstance(d, ContextParallel)]
            assert groups and all(d.degree == c.cp for d in groups)
        else:
            assert all(d.sequence_parallel for d in directives if isinstance(d, Shard))
    assert Candidate("1f1b", 2, 4, 2, cp=2).label == "1f1b pp=2 dp=2 cp=2 mb=4"
    assert Candidate("1f1b", 2, 4, tp=2, sp=True).label == "1f1b pp=2 tp=2 sp mb=4"
    assert variant_degrees("none") == (1, 1, 1, False)
