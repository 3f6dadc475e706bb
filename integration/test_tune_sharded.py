"""``piper tune`` searching sequence and context parallelism end to end (issue 37, item 7): the
``lm`` model (written-out attention, Linear pairs) on 2 devices with ``sp=(False, True)`` and
``cps=(1, 2)``: each variant is profiled on the runtime (its collectives inside the measured
times) and one rank of it for activations, every candidate is ranked or keeps its reason, and
the best sequence- and context-parallel strategies, written out, train."""

from __future__ import annotations

from pathlib import Path

import pytest

from piper_directives import Strategy
from piper_runtime import OptimizerSpec
from piper_train.trainer import Trainer
from piper_train.tuning.api import tune
from piper_train.tuning.search import OK
from piper_train.workload import load_workload

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_tune_searches_sp_and_cp_and_their_picks_train(tmp_path: Path) -> None:
    report = tune("lm", 2, stages=2, microbatches=(2,), schedules=("1f1b",), zeros=(0,), pps=(1,),
                  sp=(False, True), cps=(1, 2), comm=(5e-5, 1e9), profile_steps=2, cache_dir=tmp_path)
    by_variant = {}
    for e in report.result.evaluations:
        by_variant.setdefault(e.candidate.variant, []).append(e)
    assert {"none", "tp2", "tp2sp", "cp2"} <= set(by_variant), {v: [e.reason for e in es] for v, es in by_variant.items()}
    profile = report.profile
    for variant in ("tp2", "tp2sp", "cp2"):
        assert variant in profile.compute and variant in profile.rank_activation_bytes
        # one rank keeps less than one device
        assert sum(profile.rank_activation_bytes[variant].values()) < sum(profile.activation_bytes.values())
    for variant in ("tp2sp", "cp2"):
        best = next(e for e in by_variant[variant] if e.status == OK)
        assert best.predicted > 0 and best.peak_bytes > 0
        strategy = Strategy.from_json(best.candidate.strategy(report.regions).to_json())
        spec = load_workload("lm", stages=report.regions)
        with Trainer(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, strategy,
                     regions=spec.regions, optimizer=OptimizerSpec("adamw", 1e-3), runtime="local") as trainer:
            loss = trainer.step(spec.example_inputs, spec.example_targets).loss
        assert loss == loss and loss > 0  # a finite loss: the picked program ran


def test_the_context_parallel_rewrite_is_remembered_per_shapes() -> None:
    """The search's front door replays ``context_modules``'s result (each rank's value shapes,
    each segment's gather count) for a graph of the same shapes: the same graph as running it."""
    from piper_directives import capture, context_modules
    from piper_train.tuning.api import _Sharder
    from piper_train.tuning.space import Candidate

    spec = load_workload("lm", stages=2)
    captured = capture(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, regions=spec.regions)
    sharder = _Sharder(captured)
    for candidate in (Candidate("1f1b", 1, 2, cp=2), Candidate("gpipe", 1, 2, cp=2), Candidate("1f1b", 1, 4, cp=2)):
        placed = candidate.strategy(2).apply(captured.graph)
        fresh = context_modules(placed, captured.modules)[0]
        assert sharder(placed) == fresh
    assert len(sharder.context) == 2  # two microbatch sizes, two shapes
