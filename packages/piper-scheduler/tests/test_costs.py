"""CostModel.parse: the text form of a cost model (``--cost F=1,B=2,W=1``) and its errors."""

from __future__ import annotations

import pytest

from piper_ir import Phase
from piper_scheduler import CostModel


def _split(costs: CostModel) -> tuple[float, float, float]:
    return costs.B, costs.BI, costs.BW


@pytest.mark.parametrize(
    ("text", "split"),
    [
        ("F=1,B=2,W=1", (2.0, 1.0, 1.0)),
        ("F=1,B=3,W=1", (3.0, 2.0, 1.0)),  # BI derived, not the default 1
        ("F=1,B=3,BW=0.5", (3.0, 2.5, 0.5)),  # BW spelled out
        ("B=3,BI=2", (3.0, 2.0, 1.0)),  # BW derived
        ("BI=1.5,W=0.5", (2.0, 1.5, 0.5)),  # B derived
        ("B=3,BI=2,W=1", (3.0, 2.0, 1.0)),  # all three, consistent
        ("F=1,B=4", (4.0, 2.0, 2.0)),  # B alone: halves
        ("F=2", (2.0, 1.0, 1.0)),  # no backward given: the defaults
        ("", (2.0, 1.0, 1.0)),
        ("B=2,W=2", (2.0, 0.0, 2.0)),
    ],
)
def test_backward_halves_always_add_up(text: str, split: tuple[float, float, float]) -> None:
    costs = CostModel.parse(text)
    assert _split(costs) == split
    assert costs.B == pytest.approx(costs.BI + costs.BW)


def test_every_key_reaches_the_model() -> None:
    costs = CostModel.parse(" F=1.5 , B=3, W=1, OPT=0.25, FB=3.5, loss=0.5 ")
    assert (costs.F, costs.B, costs.BI, costs.BW, costs.OPT, costs.FB) == (1.5, 3.0, 2.0, 1.0, 0.25, 3.5)
    for phase in (Phase.F, Phase.B, Phase.BI, Phase.BW):
        assert costs.compute_cost("loss", phase) == 0.5
        assert costs.compute_cost("s0", phase) == getattr(costs, phase.value)
    assert CostModel.parse("F=1").compute_cost("loss", Phase.F) == 0.0  # the loss is free unless given
    assert CostModel.parse("F=1").FB is None
    assert costs == CostModel.parse("loss=0.5,FB=3.5,OPT=0.25,BW=1,BI=2,B=3,F=1.5")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("B=3,BI=1,BW=1", r"B = 3 but BI \+ BW = 1 \+ 1 = 2"),
        ("B=3,BI=1,W=1", r"B = 3 but BI \+ W = 1 \+ 1 = 2"),
        ("B=2,W=3", r"BI = B - W = 2 - 3 is negative; W must not exceed B"),
        ("B=1,BI=2", r"BW = B - BI = 1 - 2 is negative; BI must not exceed B"),
        ("F=1,W=1", r"W alone does not say the whole backward; give B or BI too"),
        ("BI=1", r"BI alone does not say the whole backward; give B or BW too"),
        ("F=1,B=2,FB=3.5", r"FB = 3.5 must lie in \[max\(F, B\), F \+ B\] = \[2, 3\]"),
        ("F=1,B=2,FB=1.5", r"FB = 1.5 must lie in \[max\(F, B\), F \+ B\] = \[2, 3\]"),
        ("W=1,BW=1,B=2", r"W and BW both give BW; give it once"),
        ("F=1,F=2", r"F and F both give F"),
        ("X=1", r"KEY in F, B, BI, BW \(or W\), OPT, FB, loss; got 'X=1'"),
        ("F=-1", r"got 'F=-1'"),
        ("F=x", r"got 'F=x'"),
        ("F", r"got 'F'"),
        ("F=inf", r"got 'F=inf'"),
        ("F=nan", r"got 'F=nan'"),
    ],
)
def test_inconsistent_or_malformed_costs_are_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CostModel.parse(text)


def test_messages_start_with_the_source() -> None:
    with pytest.raises(ValueError, match=r"^--cost: B = 3 but"):
        CostModel.parse("B=3,BI=1,W=1", source="--cost")


def test_pair_model_is_checked() -> None:
    assert CostModel().pairs == "halves"
    assert CostModel(pairs="atomic").pairs == "atomic"
    with pytest.raises(ValueError, match="pairs"):
        CostModel(pairs="fused")
