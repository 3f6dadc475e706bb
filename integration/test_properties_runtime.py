"""A sample of the property space run on the runtime (test_properties.py checks the rest
without processes): random schedules, pipeline and data-parallel degrees, ZeRO levels and
microbatch counts on a small MLP must either be refused by name (``PiperError``) or train
exactly as single-device training does.

Few examples and derandomized (each starts a run on Ray; the workers are pooled): the same
cases on every CI run. ``PIPER_HYPOTHESIS_RUNTIME_EXAMPLES`` raises the count.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from piper_directives import SCHEDULES, build_schedule
from piper_ir import PiperError
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import build_model

EXAMPLES = int(os.environ.get("PIPER_HYPOTHESIS_RUNTIME_EXAMPLES", "4"))


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, int, int, int, int, int]:
    """(schedule, pp, regions per rank, microbatches, dp, zero)."""
    schedule = draw(st.sampled_from(sorted(SCHEDULES)))
    pp = draw(st.sampled_from([1, 2]))
    per_rank = draw(st.sampled_from([1, 2]))
    microbatches = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.sampled_from([1, 2]))
    zero = draw(st.integers(0, 3)) if dp > 1 else 0
    return schedule, pp, per_rank, microbatches, dp, zero


@pytest.mark.usefixtures("ray_cluster")
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_a_sampled_program_is_refused_by_name_or_matches_single_device(case) -> None:
    schedule, pp, per_rank, microbatches, dp, zero = case
    stages = pp * per_rank * (2 if schedule in ("dualpipe", "dualpipev", "interleaved_1f1b") else 1)
    try:
        strategy = build_schedule(schedule, pp, microbatches, stages=stages, dp=dp, zero=zero)
    except PiperError as err:
        event(f"refused: {type(err).__name__}")
        return
    workload = build_model("mlp", stages=stages, seed=3)
    try:
        report = run_check(workload, strategy, steps=2, optimizer=OptimizerSpec("adamw", 1e-2))
    except PiperError as err:  # refused when applied or compiled, by name
        event(f"refused: {type(err).__name__}")
        assert str(err)
        return
    event("ran")
    assert report.ok, (case, report.failures())
