"""``Tie``, ``Precision`` and ``Segment.recompute``: round trip, summary, one negative test per message."""

from __future__ import annotations

import attrs
import pytest

from piper_ir import (
    Graph,
    Precision,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
    Tie,
    ValidationError,
    from_json,
    graph_summary,
    to_json,
    validate,
)

EMB = TensorMeta((16, 4), "float32", None, True)


def _tied(*ties: Tie, precision: Precision | None = None) -> Graph:
    segments = [
        Segment("s0", SegmentRole.STAGE, Tags.of(PP=0), (), (), params=(("wte.weight", EMB), ("ln.weight", EMB))),
        Segment("s1", SegmentRole.STAGE, Tags.of(PP=1), (), (), params=(("lm_head.weight", EMB),), recompute=True),
        Segment("s2", SegmentRole.STAGE, Tags.of(PP=2), (), (), params=(("small", TensorMeta((4,), "float32")),)),
    ]
    return Graph(segments, (), (), (), ties=ties, precision=precision)


TIE = Tie("wte.weight", [["s0", "wte.weight"], ["s1", "lm_head.weight"]])


def test_a_tie_round_trips_and_shows_in_the_summary() -> None:
    graph = validate(_tied(TIE, precision=Precision("bfloat16")))
    assert TIE.holders == (("s0", "wte.weight"), ("s1", "lm_head.weight"))  # lists become tuples
    assert from_json(to_json(graph)) == graph
    text = graph_summary(graph)
    assert "tie wte.weight: s0:wte.weight, s1:lm_head.weight" in text
    assert "precision: compute bfloat16, master float32" in text
    assert "segment s1 [stage] recompute" in text and "segment s0 [stage] tags" in text


def test_documents_without_the_new_fields_still_load() -> None:
    """A graph saved before ties, precision and recompute existed reads back with the defaults."""
    graph = _tied()
    doc = to_json(graph).replace(', "ties": [], "precision": null', "").replace(', "recompute": false', "")
    assert '"ties"' not in doc and '"recompute": false' not in doc
    loaded = from_json(doc)
    assert loaded.ties == () and loaded.precision is None and not loaded.segments[0].recompute


@pytest.mark.parametrize(
    ("ties", "message"),
    [
        ((Tie("w", [("s0", "wte.weight")]),), "at least two distinct segments"),
        ((Tie("w", [("s0", "wte.weight"), ("s0", "ln.weight")]),), "at least two distinct segments"),
        ((Tie("w", [("s0", "wte.weight"), ("s9", "x")]),), "unknown segment 's9'"),
        ((Tie("w", [("s0", "wte.weight"), ("s1", "nope")]),), "segment s1 has no parameter 'nope'"),
        ((Tie("w", [("s0", "wte.weight"), ("s2", "small")]),), "disagree on shape or dtype: s0:wte.weight float32"),
        ((TIE, attrs.evolve(TIE, name="other")), "in ties 'wte.weight' and 'other'"),
        ((TIE, TIE), "duplicate tied parameter 'wte.weight'"),
    ],
)
def test_bad_ties(ties: tuple[Tie, ...], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        validate(_tied(*ties))


@pytest.mark.parametrize("precision", [Precision("int8"), Precision("bfloat16", "float8")])
def test_bad_precision(precision: Precision) -> None:
    with pytest.raises(ValidationError, match="must be among"):
        validate(_tied(precision=precision))
