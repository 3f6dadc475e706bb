"""The search of ``piper tune`` on a synthetic model with a made-up profile (no torch, no
Ray): predictions are the simulator's, the ranking follows them, the budget prunes by the
memory estimate before simulating, balanced stages beat even ones on uneven regions, and
recomputation, a forward dearer, wins only under a budget nothing else meets."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest

from piper_directives import Recompute
from piper_directives.synthetic import synthetic_graph
from piper_memory import estimate_memory
from piper_scheduler import simulate
from piper_train.tuning.costs import Profile, cost_model, segment_activation_bytes
from piper_train.tuning.search import (
    DOMINATED,
    INVALID,
    OK,
    OVER_BUDGET,
    compile_candidate,
    lower_bound,
    search,
)
from piper_train.tuning.space import Candidate, enumerate_space

REGIONS, BATCH = 4, 8


def _times(local: int, heavy: float = 1.0) -> dict[str, dict[str, float]]:
    """Seconds per phase of each segment at ``local`` samples: region 0 ``heavy`` times the others."""
    out = {}
    for k in range(REGIONS):
        f = 1e-3 * local * (heavy if k == 0 else 1.0) + 2e-4
        out[f"s{k}"] = {"F": f, "B": 2 * f, "BI": 1.1 * f, "BW": 1.1 * f, "OPT": 1e-4}
    out["loss"] = {"F": 1e-5, "B": 1e-5, "BI": 1e-5, "BW": 1e-5}
    return out


def _profile(heavy: float = 1.0, cores: int | None = None) -> Profile:
    sizes = [1, 2, 4, 8]
    compute = {"none": {b: _times(b, heavy) for b in sizes}}
    return Profile("synthetic", BATCH, REGIONS, compute=compute,
                   activation_bytes={f"s{k}": 4096.0 for k in range(REGIONS)} | {"loss": 4.0},
                   overhead=1e-4, comm_overhead=5e-5, startup=1e-3, tail=5e-4, dispatch=2e-3,
                   latency=1e-4, bandwidth=1e9, cores=cores)


def _graph():
    return synthetic_graph(REGIONS, 1, hidden=64, batch=BATCH)


def _space(**kw):
    return enumerate_space(2, REGIONS, microbatches=[1, 2, 4], kinds=(), **kw)


def test_predictions_are_the_simulators_and_the_ranking_follows_them() -> None:
    graph, profile = _graph(), _profile()
    result = search(graph, profile, _space())
    fitting = result.fitting
    assert fitting and result.count(INVALID) > 0  # e.g. dualpipe needs an even pp, dualpipev 2 * pp microbatches
    predicted = [e.predicted for e in fitting]
    assert predicted == sorted(predicted)
    for e in fitting[:6]:
        program = compile_candidate(graph, e.candidate, REGIONS)
        span = simulate(program, cost_model(profile, e.candidate)).makespan
        assert e.makespan == pytest.approx(span)
        assert e.predicted == pytest.approx(span + profile.tail + profile.dispatch)
        peak = max(m.required_bytes for m in estimate_memory(
            program, activation_bytes=segment_activation_bytes(profile, e.candidate)).values())
        assert e.peak_bytes == peak
    assert result.best is fitting[0]


@pytest.mark.parametrize("cores", [None, 1])
def test_lower_bound_never_exceeds_the_prediction(cores: int | None) -> None:
    profile = _profile(heavy=2.0, cores=cores)
    space = enumerate_space(4, REGIONS, microbatches=[1, 2, 4, 8], kinds=(), weights=profile.region_weights(),
                            recompute=(False, True))
    result = search(_graph(), profile, space)
    assert len(result.fitting) > 20
    for e in result.fitting:
        assert lower_bound(profile, e.candidate) <= e.predicted + 1e-12, e.candidate.label


def test_keep_ranks_the_top_k_exactly_and_compiles_less() -> None:
    profile = _profile(heavy=2.0)
    space = enumerate_space(4, REGIONS, microbatches=[1, 2, 4, 8], kinds=(), weights=profile.region_weights())
    full = search(_graph(), profile, space)
    top = search(_graph(), profile, space, keep=5)
    assert [(e.candidate, e.predicted) for e in top.fitting[:5]] == [(e.candidate, e.predicted) for e in full.fitting[:5]]
    assert top.count(DOMINATED) > 0 and top.count(DOMINATED) + len(top.fitting) <= len(full.fitting) + top.count(DOMINATED)
    assert all(e.predicted is None and e.peak_bytes is None for e in top.evaluations if e.status == DOMINATED)


def test_cores_bound_the_step_when_ranks_share_them() -> None:
    graph = _graph()
    alone = search(graph, _profile(), [Candidate("1f1b", 2, 4)]).best
    shared = search(graph, _profile(cores=1), [Candidate("1f1b", 2, 4)]).best
    assert alone is not None and shared is not None and shared.predicted >= alone.predicted


def test_budget_prunes_before_simulating() -> None:
    graph, profile = _graph(), _profile()
    free = search(graph, profile, _space())
    peaks = sorted({e.peak_bytes for e in free.fitting})
    budget = peaks[len(peaks) // 2]
    pruned = search(graph, profile, _space(), budget_bytes=budget)
    over = [e for e in pruned.evaluations if e.status == OVER_BUDGET]
    assert over and pruned.fitting
    assert all(e.peak_bytes > budget and e.predicted is None for e in over)
    assert all(e.peak_bytes <= budget for e in pruned.fitting)
    assert {e.candidate for e in pruned.fitting} == {e.candidate for e in free.fitting if e.peak_bytes <= budget}
    nothing = search(graph, profile, _space(), budget_bytes=1)
    assert nothing.best is None
    assert nothing.smallest_requirement is not None and nothing.smallest_requirement.peak_bytes == peaks[0]


def test_zero_lowers_the_estimate_that_the_budget_checks() -> None:
    graph, profile = _graph(), _profile()
    dp = [Candidate("1f1b", 1, 2, dp=2, zero=z) for z in (0, 1, 2, 3)]
    peaks = [e.peak_bytes for e in sorted(search(graph, profile, dp).evaluations, key=lambda e: e.candidate.zero)]
    assert peaks[3] < peaks[0]
    budget = peaks[0] - 1  # too small for ZeRO-0
    best = search(graph, profile, dp, budget_bytes=budget).best
    assert best is not None and best.candidate.zero > 0 and best.peak_bytes <= budget


def test_recomputing_costs_a_forward_and_wins_only_where_memory_demands_it() -> None:
    graph, profile = _graph(), _profile()
    space = _space(schedules=["1f1b", "gpipe"], recompute=(False, True))
    assert {c.recompute for c in space} == {False, True}
    assert all(not c.recompute or (c.tp == c.ep == 1) for c in enumerate_space(
        4, REGIONS, microbatches=[2], kinds=("tp",), recompute=(False, True)))
    free = search(graph, profile, space)
    by = {e.candidate: e for e in free.fitting}
    pairs = [(by[c], by[attrs.evolve(c, recompute=True)]) for c in by if not c.recompute]
    assert pairs
    for kept, again in pairs:  # a forward more per microbatch, its activations held for one at a time
        assert again.predicted > kept.predicted and again.peak_bytes < kept.peak_bytes
    assert not free.best.candidate.recompute  # unconstrained, recomputing only costs
    budget = min(e.peak_bytes for e in free.fitting if not e.candidate.recompute) - 1
    tight = search(graph, profile, space, budget_bytes=budget)
    assert tight.best is not None and tight.best.candidate.recompute and tight.best.peak_bytes <= budget
    strategy = tight.best.candidate.strategy(REGIONS)
    assert strategy.of(Recompute) == [Recompute({})] and "recompute" in tight.best.candidate.label


def test_balanced_stages_win_on_uneven_regions() -> None:
    graph, profile = _graph(), _profile(heavy=3.0)
    result = search(graph, profile, _space(weights=profile.region_weights(), schedules=["1f1b"]))
    even = next(e for e in result.fitting if e.candidate == Candidate("1f1b", 2, 4))
    balanced = next(e for e in result.fitting if e.candidate.pp == 2 and e.candidate.microbatches == 4
                    and e.candidate.bounds is not None)
    assert balanced.candidate.bounds == (0, 1, 4)
    assert balanced.predicted < even.predicted


def test_invalid_candidates_say_why() -> None:
    result = search(_graph(), _profile(), [Candidate("1f1b", 1, 3, dp=2), Candidate("dualpipe", 1, 2, dp=2),
                                           Candidate("1f1b", 2, 2, bounds=(0, 4, 4))])
    reasons = {e.candidate: e.reason for e in result.evaluations}
    assert all(e.status == INVALID and e.predicted is None for e in result.evaluations)
    assert "a batch of 8 does not split into 3 microbatches x 2 shards" in reasons[Candidate("1f1b", 1, 3, dp=2)]
    assert "even number of ranks" in reasons[Candidate("dualpipe", 1, 2, dp=2)]
    assert "non-empty stages" in reasons[Candidate("1f1b", 2, 2, bounds=(0, 4, 4))]


def test_missing_profile_entry_is_reported_not_guessed() -> None:
    profile = _profile()
    e = search(_graph(), profile, [Candidate("1f1b", 1, 2, tp=2)]).evaluations[0]
    assert e.status != OK


def test_profile_json_round_trip() -> None:
    profile = _profile(cores=2)
    assert Profile.from_json(profile.to_json()) == profile
    inf = Profile("k", 8, 4)
    assert Profile.from_json(inf.to_json()) == inf


def test_search_modules_import_no_torch() -> None:
    code = ("import sys; import piper_train.tuning.search, piper_train.tuning.space, piper_train.tuning.costs; "
            "sys.exit('torch' in sys.modules or 'ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_sharded_variants_use_their_own_times_and_one_ranks_activations() -> None:
    """A tp-with-sp or cp candidate is simulated with its variant's measured times (their
    collectives inside, as TP's are) and estimated with what one rank of the variant keeps
    (``rank_activation_bytes``); one device's bytes only where that was not measured."""
    profile = _profile()
    half = {seg: b / 2 for seg, b in profile.activation_bytes.items()}
    compute = {**profile.compute, "tp2sp": {4: _times(4, 1.5)}, "cp2": {4: _times(4, 1.2)}}
    profile = attrs.evolve(profile, compute=compute, rank_activation_bytes={"cp2": half, "tp2sp": half})
    graph = _graph()
    for candidate in (Candidate("1f1b", 1, 2, tp=2, sp=True), Candidate("1f1b", 1, 2, cp=2)):
        assert segment_activation_bytes(profile, candidate) == {s: int(b * 4) for s, b in half.items()}
        plain = attrs.evolve(candidate, sp=False, cp=1, tp=1)
        assert segment_activation_bytes(profile, plain) == {s: int(b * 4) for s, b in profile.activation_bytes.items()}
        e = search(graph, profile, [candidate]).evaluations[0]
        assert e.status == OK, e.reason
        program = compile_candidate(graph, candidate, REGIONS)
        assert e.makespan == pytest.approx(simulate(program, cost_model(profile, candidate)).makespan)
        estimates = estimate_memory(program, activation_bytes=segment_activation_bytes(profile, candidate))
        assert e.peak_bytes == max(x.required_bytes for x in estimates.values())
    # the same compute without the measured variant: not guessed
    missing = search(graph, profile, [Candidate("1f1b", 1, 4, tp=2, sp=True)]).evaluations[0]
    assert missing.status == INVALID and "no profile for tp2sp" in missing.reason
