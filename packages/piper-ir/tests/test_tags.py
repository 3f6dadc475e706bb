"""Tags, Filter semantics and TensorMeta arithmetic."""

from __future__ import annotations

import pytest

from piper_ir import ANY, MB, PASS, SEG, Filter, Node, NodeKind, Phase, Tags, TensorMeta


def _node(**kwargs: object) -> Node:
    return Node("n", kwargs.pop("kind", NodeKind.COMPUTE), **kwargs)  # type: ignore[arg-type]


F1 = _node(segment="s1", phase=Phase.F, microbatch=2, tags=Tags.of(PP=1, EP=3))


def test_tags_are_sorted_and_equal_regardless_of_order() -> None:
    a = Tags.of({"PP": 1}, EP=3)
    b = Tags((("EP", 3), ("PP", 1)))
    assert a == b and hash(a) == hash(b)
    assert a.items == (("EP", 3), ("PP", 1))
    assert a.as_dict() == {"EP": 3, "PP": 1}
    assert a.get("PP") == 1 and a.get("DP") is None
    assert str(a) == "EP=3,PP=1"
    assert str(Tags()) == "" and Tags().as_dict() == {}


def test_tags_of_keyword_overrides_mapping() -> None:
    assert Tags.of({"PP": 1}, PP=2).get("PP") == 2


@pytest.mark.parametrize("bad", [{"": 1}, {"PP": True}, {"PP": 1.5}, {"PP": None}])
def test_tags_reject_bad_items(bad: dict) -> None:
    with pytest.raises(TypeError):
        Tags.of(bad)


def test_tags_are_immutable() -> None:
    import attrs

    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Tags.of(PP=1).items = ()  # type: ignore[misc]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, True),
        ({"PP": 1}, True),
        ({"PP": 0}, False),
        ({"PP": ANY}, True),
        ({"PP": 1, "EP": 3}, True),
        ({"PP": 1, "EP": 4}, False),
        ({"DP": ANY}, False),  # a missing tag never matches, not even "*"
        ({"DP": 0}, False),
        ({PASS: "F"}, True),
        ({PASS: "B"}, False),
        ({PASS: ANY}, True),
        ({MB: 2}, True),
        ({MB: 0}, False),
        ({MB: ANY}, True),
        ({SEG: "s1"}, True),
        ({SEG: "s0"}, False),
        ({SEG: ANY}, True),
        ({PASS: "F", MB: 2, "PP": 1, SEG: "s1"}, True),
        ({"PP": "1"}, False),  # values compare exactly: the string "1" is not the index 1
    ],
)
def test_filter_matches(spec: dict, expected: bool) -> None:
    assert Filter.of(spec).matches(F1) is expected


@pytest.mark.parametrize("key", [PASS, MB, SEG, "PP"])
def test_filter_on_missing_key_fails_even_with_wildcard(key: str) -> None:
    bare = _node(kind=NodeKind.SEND)  # no phase, microbatch, segment or tags
    assert not Filter.of({key: ANY}).matches(bare)
    assert Filter.of().matches(bare)


def test_filter_pass_accepts_phase_enum() -> None:
    # Phase is a StrEnum, so Filter.of(PASS=Phase.B) equals the string "B".
    node = _node(phase=Phase.B)
    assert Filter.of(PASS=Phase.B).matches(node)
    assert not Filter.of(PASS=Phase.BW).matches(node)


def test_filter_keys() -> None:
    assert (PASS, MB, SEG, ANY) == ("PASS", "MB", "SEG", "*")
    f = Filter.of({"PP": 1}, PASS="F")
    assert f == Filter.of(PASS="F", PP=1)
    assert f.as_dict() == {"PASS": "F", "PP": 1}
    assert str(f) == "{PASS: 'F', PP: 1}"


def test_tensor_meta_numel_and_nbytes() -> None:
    assert TensorMeta((4, 8), "float32").numel() == 32
    assert TensorMeta((4, 8), "float32").nbytes() == 128
    assert TensorMeta((4, 8), "bfloat16").nbytes() == 64
    assert TensorMeta((3,), "int64").nbytes() == 24
    assert TensorMeta((3,), "bool").nbytes() == 3
    assert TensorMeta((), "float64").numel() == 1  # a scalar
    assert TensorMeta((), "float64").nbytes() == 8
    assert TensorMeta((2, 0), "float32").nbytes() == 0
    assert TensorMeta((5,), "complex-thing").nbytes() == 20  # unknown dtypes count 4 bytes


def test_tensor_meta_split() -> None:
    meta = TensorMeta([16, 64, 8], "float32", batch_dim=0, requires_grad=True)
    assert meta.shape == (16, 64, 8)  # lists are converted to tuples
    part = meta.split(4)
    assert part == TensorMeta((4, 64, 8), "float32", batch_dim=0, requires_grad=True)
    assert meta.split(1) == meta
    assert TensorMeta((8, 6), "float32", batch_dim=1).split(3).shape == (8, 2)


def test_tensor_meta_split_without_batch_dim_is_unchanged() -> None:
    meta = TensorMeta((64, 64), "float32")
    assert meta.split(4) is meta


def test_filter_value_sets_match_any_member() -> None:
    assert Filter.of(MB=(0, 2)).matches(F1) and not Filter.of(MB=(0, 1)).matches(F1)
    assert Filter.of(PP=[1, 3], PASS=("F", "B")).matches(F1)  # a list is kept as a tuple
    assert Filter.of(PP=[1, 3]).as_dict() == {"PP": (1, 3)}
    assert str(Filter.of(MB=(0, 1))) == "{MB: (0, 1)}"
    assert not Filter.of(MB=(0, 2)).matches(_node(kind=NodeKind.SEND))  # absent never matches


@pytest.mark.parametrize("bad", [{"MB": ()}, {"MB": (0, ANY)}, {"MB": (0, True)}, {"MB": (0, 1.5)}])
def test_filter_rejects_bad_value_sets(bad: dict) -> None:
    with pytest.raises(TypeError):
        Filter.of(bad)


def test_filter_value_sets_round_trip_json() -> None:
    from piper_ir import from_json, to_json

    f = Filter.of(PP=1, MB=(4, 5, 6))
    assert from_json(to_json(f)) == f
    with pytest.raises(TypeError):
        Tags.of(PP=(1, 2))  # tags hold one index per annotation
