"""``piper_ir.slot_maker``: a positional constructor through the slots makes what the
class's ``__init__`` makes, stays frozen, and refuses classes whose ``__init__`` does more
than set fields."""

from __future__ import annotations

import attrs
import pytest

from piper_ir import (
    Bucket,
    Edge,
    EdgeKind,
    ExecutionOptions,
    Graph,
    Instruction,
    Node,
    NodeKind,
    Phase,
    Tags,
    TensorMeta,
    slot_maker,
)
from piper_ir.construct import _descriptor_maker

CASES = [
    (Instruction, ("send.a", NodeKind.SEND, "pp", None, None, 3, "a", 1, "pp.fwd", TensorMeta((2, 4), "float32"),
                   ("ev.F.s0.mb3",), None, None)),
    (Instruction, ("F.s0.mb0", NodeKind.COMPUTE, "compute", "s0", Phase.F, 0, None, None, None, None, (), "ev.x", 2)),
    (Node, ("F.s0.mb1", NodeKind.COMPUTE, "s0", Phase.F, 1, Tags.of({"PP": 0}), (0, 1), "compute", None, (), "Place")),
    (Edge, ("F.s0.mb1", "F.s1.mb1", EdgeKind.TEMPORAL, None, "Order")),
]


@pytest.mark.parametrize(("cls", "values"), CASES)
def test_it_makes_what_init_makes(cls, values) -> None:
    made, want = slot_maker(cls)(*values), cls(*values)
    assert type(made) is cls
    assert made == want and hash(made) == hash(want) and repr(made) == repr(want)
    assert attrs.astuple(made, recurse=False) == values
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        made.id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(("cls", "values"), CASES)
def test_the_descriptor_maker_makes_the_same(cls, values) -> None:
    """What ``slot_maker`` falls back to where ``__class__`` cannot be assigned."""
    made = _descriptor_maker(cls, [a.name for a in attrs.fields(cls)])(*values)
    assert type(made) is cls and made == cls(*values)


@pytest.mark.parametrize("cls", [Instruction, Node, Edge])
def test_every_field_is_passed(cls) -> None:
    with pytest.raises(TypeError):
        slot_maker(cls)("only-one")


@pytest.mark.parametrize(
    ("cls", "why"),
    [(ExecutionOptions, "checks its fields"), (Bucket, "checks its fields"), (Graph, "slots besides its fields")],
)
def test_classes_whose_init_does_more_are_refused(cls, why) -> None:
    with pytest.raises(TypeError, match=why):
        slot_maker(cls)
