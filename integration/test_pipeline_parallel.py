"""GPipe and 1F1B on the Ray runtime (gloo, CPU) against single-device training.

The oracle is ``piper_train.check.run_check``: every microbatch loss and every gradient in
each of 3 steps, then every parameter, within rtol 1e-5 / atol 1e-6 in fp32.
"""

from __future__ import annotations

import pytest

from piper_directives import build_schedule
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import build_model

pytestmark = pytest.mark.usefixtures("ray_cluster")
SGD = OptimizerSpec("sgd", 0.05, {"momentum": 0.9})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_mlp(schedule, pp, microbatches):
    workload = build_model("mlp", stages=pp, seed=pp * 10 + microbatches)
    report = run_check(workload, build_schedule(schedule, pp, microbatches), optimizer=SGD)
    assert report.ok, report.failures()
    assert len(report.program.ranks) == pp and report.program.microbatches == microbatches
    params = 2 * pp + 2  # weight and bias of one Linear per stage, plus the output Linear
    assert len(report.differences) == 3 * (microbatches + params) + params  # every loss, grad, param


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (4, 8)])
def test_tiny_transformer(schedule, pp, microbatches):
    workload = build_model("transformer", stages=pp, seed=3)
    report = run_check(workload, build_schedule(schedule, pp, microbatches), optimizer=OptimizerSpec("adamw", 1e-3))
    assert report.ok, report.failures()


def test_two_regions_per_rank():
    """The strategy, not the model, decides how many annotated regions each rank holds."""
    workload = build_model("mlp", stages=4, seed=1)
    report = run_check(workload, build_schedule("1f1b", 2, 4, stages=4), optimizer=SGD)
    assert report.ok, report.failures()
    assert [len(plan.segments()) for plan in report.program.ranks] == [2, 3]  # rank 1 also runs the loss


@pytest.mark.parametrize("schedule", ["1f1b", "zb1p"])
def test_sequential_walk_matches_single_device(schedule):
    """``threads=False``: each rank walks its whole list on one thread (the same plan)."""
    workload = build_model("mlp", stages=2, seed=11)
    report = run_check(workload, build_schedule(schedule, 2, 4), optimizer=SGD, threads=False)
    assert report.ok, report.failures()
