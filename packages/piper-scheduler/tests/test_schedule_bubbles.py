"""The simulator against the published bubble and memory figures of the schedule library.

Plans are built the way a user builds them: the directive schedule builders
(``piper_directives``) applied to a captured model of tiny annotated regions, then
``compile_program``. The loss costs nothing so only the stages count; idle is makespan minus
a rank's busy time. Formulas (DeepSeek's DualPipe README table, ZB paper), with B = BI + BW
and W = BW:

- ZB1P (ZB-H1): idle ``(PP-1)(F+B-2W)`` on every rank when ``W <= F`` and ``W <= B-W``;
  peak activations ``PP`` (as 1F1B).
- 1F1B: ``(PP-1)(F+B)``; interleaved 1F1B with v chunks per rank, each costing 1/v of a
  stage: ``(PP-1)(F+B)/v``.
- DualPipeV (PP = 2 x ranks stages): peak activations ``PP+1`` on every rank; idle at most
  ``(PP/2-1)(F&B+B-3W)`` with F&B = F+B (our overlapped slot runs its two halves back to back).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
directives = pytest.importorskip("piper_directives")

from piper_scheduler import CostModel, compile_program, simulate  # noqa: E402

BATCH = 24  # divisible by every microbatch count below


class Regions(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            with directives.annotate("PP"):
                x = torch.tanh(layer(x))
        return x


_GRAPHS: dict[int, object] = {}


def _program(schedule: str, pp: int, microbatches: int, regions: int):
    if regions not in _GRAPHS:
        torch.manual_seed(0)
        model = Regions(regions)
        _GRAPHS[regions] = directives.capture(
            model, (torch.randn(BATCH, 2),), (torch.randn(BATCH, 2),), torch.nn.functional.mse_loss
        ).graph
    strategy = directives.build_schedule(schedule, pp, microbatches, stages=regions)
    return compile_program(strategy.apply(_GRAPHS[regions]))


def _costs(f: float, bi: float, bw: float) -> CostModel:
    return CostModel(F=f, B=bi + bw, BI=bi, BW=bw, overrides={"loss": {"F": 0, "B": 0}})


# (F, BI, BW): unit costs and uneven ones, all with W <= F and W <= B - W.
ZB_COSTS = [(1, 1, 1), (2, 2, 1), (1, 1.5, 0.5), (3, 2, 1), (2, 3, 1), (1.5, 1, 0.25)]


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 2), (2, 6), (3, 3), (3, 6), (4, 4), (4, 8), (4, 12)])
def test_zb1p_bubble_and_memory(pp, microbatches):
    program = _program("zb1p", pp, microbatches, pp)
    for f, bi, bw in ZB_COSTS:
        b, w = bi + bw, bw
        assert w <= f and w <= b - w
        timeline = simulate(program, _costs(f, bi, bw))
        assert timeline.idle == pytest.approx([(pp - 1) * (f + b - 2 * w)] * pp), (f, bi, bw)
    assert max(simulate(program, _costs(1, 1, 1)).peak_memory) == pp


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (4, 8)])
def test_zb1p_beats_1f1b_by_the_weight_passes(pp, microbatches):
    costs = _costs(1, 1, 1)
    one_f_one_b = simulate(_program("1f1b", pp, microbatches, pp), costs)
    zero_bubble = simulate(_program("zb1p", pp, microbatches, pp), costs)
    assert one_f_one_b.idle == pytest.approx([(pp - 1) * 3] * pp)
    assert zero_bubble.idle == pytest.approx([(pp - 1) * 1] * pp)


@pytest.mark.parametrize(("pp", "v", "microbatches"), [(2, 2, 4), (2, 3, 6), (4, 2, 8), (3, 2, 6)])
def test_interleaved_bubble_shrinks_with_virtual_stages(pp, v, microbatches):
    program = _program("interleaved_1f1b", pp, microbatches, pp * v)
    f, b = 1.0, 2.0
    timeline = simulate(program, CostModel(F=f / v, B=b / v, overrides={"loss": {"F": 0, "B": 0}}))
    assert timeline.idle == pytest.approx([(pp - 1) * (f + b) / v] * pp)


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (2, 8), (4, 8), (4, 12)])
def test_dualpipev_memory_and_bubble_bound(ranks, microbatches):
    program = _program("dualpipev", ranks, microbatches, 2 * ranks)
    stages = 2 * ranks
    for f, w in [(1, 1), (2, 1), (1, 0.5)]:
        b = f + w  # the table's assumption B = F + W, with BI = F
        timeline = simulate(program, _costs(f, f, w))
        assert list(timeline.peak_memory) == [stages + 1] * ranks
        assert max(timeline.idle) <= (stages // 2 - 1) * ((f + b) + b - 3 * w) + 1e-9
