"""Where compile puts a rank's optimizer steps (``compile._optimizer_steps_early``).

A rank holding several segments (interleaved 1F1B, DualPipe) steps a segment once its last
weight gradient is made, while its other segments still wait for the next rank's
gradients; the simulator says no schedule's step gets longer for it and interleaved 1F1B's
gets shorter. Where another rank waits for something after the backwards (a reduction, the
gradient norm), or a parameter is shared between segments, the steps stay at the end.
Plans are built as a user builds them: a captured model of tiny annotated regions, the
directive schedule builders, ``compile_program``.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
directives = pytest.importorskip("piper_directives")
piper_memory = pytest.importorskip("piper_memory")

from piper_ir import NodeKind, Phase  # noqa: E402
from piper_scheduler import CostModel, compile_program, simulate  # noqa: E402
from piper_scheduler import compile as compile_module  # noqa: E402

BATCH = 24


class Regions(torch.nn.Module):
    def __init__(self, n: int, *, tie: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(n))
        if tie:  # the first and the third region hold one Linear: rank 0's two segments under interleaved pp=2
            self.layers[2] = self.layers[0]

    def forward(self, x):
        for layer in self.layers:
            with directives.annotate("PP"):
                x = torch.tanh(layer(x))
        return x


def _graph(regions: int, *, tie: bool = False):
    torch.manual_seed(0)
    return directives.capture(
        Regions(regions, tie=tie), (torch.randn(BATCH, 2),), (torch.randn(BATCH, 2),), torch.nn.functional.mse_loss
    ).graph


def _program(schedule: str, pp: int, microbatches: int, regions: int, *, tie: bool = False, clip: bool = False,
             **parallel):
    strategy = directives.build_schedule(schedule, pp, microbatches, stages=regions)
    if parallel:
        strategy = directives.parallelize(strategy, **parallel)
    graph = strategy.apply(_graph(regions, tie=tie))
    if clip:  # the gradient norm, as ``Trainer`` adds it for ``clip_grad_norm``
        graph = piper_memory.add_grad_norm(graph, 1.0)
    return compile_program(graph)


def _compute(plan) -> list:
    return [i for i in plan.instructions if i.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER)]


def _steps_after_every_compute(plan) -> bool:
    kinds = [i.kind for i in _compute(plan)]
    first = kinds.index(NodeKind.OPTIMIZER)
    return all(k is NodeKind.OPTIMIZER for k in kinds[first:])


def test_interleaved_first_rank_steps_its_later_segment_while_waiting_for_the_earlier_ones_gradients():
    program = _program("interleaved_1f1b", 2, 8, 4)
    first, last = (_compute(plan) for plan in program.ranks)
    opt = next(k for k, i in enumerate(first) if i.kind is NodeKind.OPTIMIZER)
    stepped = first[opt].segment
    # right after that segment's last backward, and before the other segment's last backwards
    assert first[opt - 1].segment == stepped and first[opt - 1].phase is Phase.B and first[opt - 1].microbatch == 7
    assert [(i.segment != stepped, i.phase) for i in first[opt + 1:]] == [(True, Phase.B)] * 2 + [(True, Phase.OPT)]
    # the last rank's last backwards send gradients to rank 0: its steps stay at its end
    assert [i.kind for i in last[-2:]] == [NodeKind.OPTIMIZER] * 2 and _steps_after_every_compute(program.ranks[1])


# Instruction times measured on interleaved 1F1B's ranks (ms; ``benchmarks/bench_timeline.py
# --model stack --schedule interleaved_1f1b --pp 2``): the first segment's backward makes no
# input gradient, the loss's backward is its last segment's.
MEASURED = CostModel(F=2.25, B=3.8, OPT=1.37, overrides={"s0": {"B": 3.3}, "s1": {"B": 4.1}, "loss": {"F": 0.12, "B": 0}})


def _uneven(seed: int) -> CostModel:
    """Each segment's forward and backward drawn apart (the loss's too): ranks wait on each other."""
    rng = random.Random(seed)
    overrides = {f"s{k}": {"F": rng.uniform(1, 3), "B": rng.uniform(2, 5)} for k in range(8)}
    overrides["loss"] = {"F": rng.uniform(0, 0.5), "B": rng.uniform(0, 1)}
    return CostModel(F=1, B=2, BI=1, BW=1, OPT=rng.uniform(0.3, 2), overrides=overrides)


COSTS = [CostModel(F=1, B=2, BI=1, BW=1, OPT=opt, overrides={"loss": {"F": 0, "B": 0}}) for opt in (0.5, 1.5)]
COSTS += [MEASURED, *map(_uneven, range(20))]


def _both(schedule: str, pp: int, microbatches: int, regions: int, monkeypatch):
    """The program as compiled, and as compiled with every step left where the Kahn order put it."""
    moved = _program(schedule, pp, microbatches, regions)
    with monkeypatch.context() as m:
        m.setattr(compile_module, "_optimizer_steps_early", lambda graph, orders, overlap: orders)
        kept = _program(schedule, pp, microbatches, regions)
    for a, b in zip(moved.ranks, kept.ranks, strict=True):  # the same instructions, only their order differs
        assert sorted(i.id for i in a.instructions) == sorted(i.id for i in b.instructions)
    return moved, kept


@pytest.mark.parametrize(("schedule", "pp", "regions"), [
    ("gpipe", 2, 2), ("1f1b", 4, 4), ("interleaved_1f1b", 2, 4), ("interleaved_1f1b", 4, 8), ("zb1p", 2, 2),
    ("dualpipe", 4, 4), ("dualpipev", 2, 4), ("dualpipev", 4, 8),
])
def test_moving_steps_never_makes_a_step_longer(monkeypatch, schedule, pp, regions):
    moved, kept = _both(schedule, pp, 8, regions, monkeypatch)
    for cost in COSTS:
        assert simulate(moved, cost).makespan <= simulate(kept, cost).makespan + 1e-9


def test_interleaved_steps_are_shorter_at_the_measured_times(monkeypatch):
    moved, kept = _both("interleaved_1f1b", 2, 8, 4, monkeypatch)
    # the first rank waited 1.1 ms for the next rank's gradients with the later segment's step still to run
    assert simulate(moved, MEASURED).makespan == pytest.approx(simulate(kept, MEASURED).makespan - 1.1)
    # and where the drawn times make it wait so (8 of these 20 draws; the others never wait there)
    assert sum(simulate(moved, c).makespan < simulate(kept, c).makespan - 1e-9 for c in COSTS[3:]) >= 5


@pytest.mark.parametrize("parallel", [{"dp": 2}, {"dp": 2, "zero": 1}, {"clip": True}, {"tie": True}],
                         ids=["dp2", "zero1", "grad-norm", "tied"])
def test_steps_stay_last_where_a_reduction_follows_or_segments_share_a_parameter(parallel):
    program = _program("interleaved_1f1b", 2, 4, 4, **parallel)
    assert all(_steps_after_every_compute(plan) for plan in program.ranks)
