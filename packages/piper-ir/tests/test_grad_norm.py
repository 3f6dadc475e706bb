"""The gradient norm's IR values: NormTerm's local checks, GradNorm per rank, their JSON
round trip inside a Program, the GRAD_NORM instruction's label."""

from __future__ import annotations

import pytest

from piper_ir import (
    COMMUNICATION_KINDS,
    GradNorm,
    Instruction,
    NodeKind,
    NormTerm,
    Program,
    RankPlan,
    from_json,
    to_json,
)


def test_terms_per_rank_and_a_program_round_trip() -> None:
    norm = GradNorm(
        1.0,
        (NormTerm(0, "s0", param="l.weight"), NormTerm(1, "s1", bucket="bucket:s1:0", ranges=[[0, 3], [5, 9]])),
    )
    assert norm.terms_of(1) == (NormTerm(1, "s1", bucket="bucket:s1:0", ranges=((0, 3), (5, 9))),)
    assert norm.terms_of(2) == ()
    ins = Instruction("grad_norm", NodeKind.GRAD_NORM, communicator="norm:0-1")
    program = Program(2, (RankPlan(0, (ins,)), RankPlan(1, (ins,))), (), (), (), (), (), grad_norm=norm)
    assert from_json(to_json(program)) == program
    assert from_json(to_json(GradNorm())) == GradNorm()  # measure only, no terms
    assert ins.short() == "GRAD_NORM" and NodeKind.GRAD_NORM in COMMUNICATION_KINDS


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "names a parameter or a bucket"),
        ({"param": "w", "bucket": "b"}, "names a parameter or a bucket"),
        ({"bucket": "b", "ranges": [(3, 3)]}, "bad ranges"),
        ({"bucket": "b", "ranges": [(-1, 2)]}, "bad ranges"),
    ],
)
def test_a_term_names_one_piece(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NormTerm(0, "s0", **kwargs)
