"""``device_count``: the ranks a strategy runs on, known before the model is captured (what
lets a runtime start its ranks' machinery meanwhile: ``piper_runtime.prepare_runtime``)."""

from __future__ import annotations

import pytest

from piper_directives import (
    SizedStrategy,
    build_schedule,
    context_parallel,
    device_count,
    parallelize,
    synthetic_graph,
)


@pytest.mark.parametrize(
    ("schedule", "pp", "degrees", "cp"),
    [("1f1b", 2, {}, 1), ("dualpipev", 2, {"dp": 2, "zero": 1}, 1), ("interleaved_1f1b", 2, {"tp": 2}, 1),
     ("gpipe", 2, {"dp": 2}, 2), ("zb1p", 4, {}, 2)],
)
def test_the_device_count_is_every_device_the_applied_strategy_uses(schedule, pp, degrees, cp):
    stages = 2 * pp
    strategy = context_parallel(parallelize(build_schedule(schedule, pp, 4, stages=stages), **degrees), cp)
    graph = strategy.apply(synthetic_graph(stages, 4, batch=16))
    used = {d for node in graph.nodes for d in node.devices}
    assert device_count(strategy) == len(used) == max(used) + 1
    sized = SizedStrategy(lambda regions: strategy, devices=device_count(strategy))
    assert device_count(sized) == device_count(strategy) and sized(stages) is strategy
    assert device_count(lambda regions: strategy) is None  # a bare function says nothing before
