"""The text form of instructions and listings: it parses back exactly, the label is
``short()``, and every malformed line is refused with a ``SerializationError`` saying why."""

from __future__ import annotations

import re

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from piper_ir import (
    Communicator,
    Instruction,
    Listing,
    NodeKind,
    Phase,
    RankPlan,
    SerializationError,
    TensorMeta,
    format_instruction,
    format_listing,
    parse_instruction,
    parse_listing,
)
from piper_ir.text import FIELD_KEYS

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Plain tokens like the compiler's ids, and strings the text form must quote: empty, spaces,
# quotes, '#', '=', ',', "None", non-ASCII, newlines.
TRICKY = ["", " ", "a b", '"', "x#1", "k=v", "a,b", "None", "é", "line\nbreak", "->1", "\\", "s0:F0"]
plain = st.from_regex(r"[A-Za-z0-9_.:/@+\-]{1,12}", fullmatch=True)
strings = plain | st.sampled_from(TRICKY) | st.text(max_size=6)
maybe = st.none() | strings
ints = st.integers(-3, 2**40)
metas = st.builds(
    TensorMeta,
    shape=st.lists(st.integers(-2, 4096), max_size=4).map(tuple),
    dtype=st.sampled_from(["float32", "bfloat16", "int64"]) | strings,
    batch_dim=st.none() | st.integers(-1, 3),
    requires_grad=st.booleans(),
)
instructions = st.builds(
    Instruction,
    id=strings,
    kind=st.sampled_from(NodeKind),
    stream=strings,
    segment=maybe,
    phase=st.none() | st.sampled_from(Phase),
    microbatch=st.none() | ints,
    value=maybe,
    peer=st.none() | ints,
    communicator=maybe,
    meta=st.none() | metas,
    waits=st.lists(strings, max_size=3).map(tuple),
    record=maybe,
    overlap=st.none() | ints,
)


@FAST
@given(instructions)
def test_parse_of_print_is_the_instruction(ins: Instruction) -> None:
    text = format_instruction(ins)
    assert "\n" not in text
    assert parse_instruction(text) == ins
    assert Instruction.parse(ins.text()) == ins


@FAST
@given(instructions)
def test_label_is_short_whenever_it_carries_the_fields(ins: Instruction) -> None:
    text = ins.text()
    if text.startswith(("id=", "kind=")):  # no label: a field the label needs is missing or odd
        return
    assert text == ins.short() or text.startswith(ins.short() + " ")


@FAST
@given(st.lists(instructions, max_size=4), st.lists(instructions, max_size=3))
def test_listing_round_trip(first: list[Instruction], second: list[Instruction]) -> None:
    listing = Listing(
        [Communicator("pp.fwd", (0, 1), "activations"), Communicator("a b", (), '"x"')],
        [RankPlan(0, first), RankPlan(1, second, replica=1)],
    )
    assert parse_listing(format_listing(listing, ["made by a test", ""])) == listing


def test_every_instruction_field_has_a_key() -> None:
    assert set(FIELD_KEYS) == {f.name for f in attrs.fields(Instruction)}
    assert len(set(FIELD_KEYS.values())) == len(FIELD_KEYS)


META = TensorMeta((1, 4), "float32", 0, True)
EXAMPLES = [
    (
        Instruction("F.s0.mb3", NodeKind.COMPUTE, segment="s0", phase=Phase.F, microbatch=3, record="ev.F.s0.mb3"),
        "s0:F3 id=F.s0.mb3 record=ev.F.s0.mb3",
    ),
    (Instruction("OPT.s1", NodeKind.OPTIMIZER, segment="s1", phase=Phase.OPT), "s1:OPT id=OPT.s1"),
    (
        Instruction("BW.s1.mb0", NodeKind.COMPUTE, segment="s1", phase=Phase.BW, microbatch=0, overlap=2),
        "s1:BW0 id=BW.s1.mb0 overlap=2",
    ),
    (
        Instruction("s", NodeKind.SEND, "pp", microbatch=0, value="v:s0", peer=1, communicator="pp.fwd",
                    meta=META, waits=("ev.a", "ev.b")),
        "SEND v:s0#0 ->1 id=s stream=pp comm=pp.fwd meta=float32[1,4]/b0/g waits=ev.a,ev.b",
    ),
    (
        Instruction("r", NodeKind.RECV, "pp", microbatch=2, value="grad:v:s0", peer=0, communicator="pp.bwd"),
        "RECV grad:v:s0#2 <-0 id=r stream=pp comm=pp.bwd",
    ),
    (
        Instruction("m", NodeKind.MATERIALIZE, "dp", segment="s0", value="bucket:s0:0", communicator="dp:0-2",
                    meta=TensorMeta((20,), "float32")),
        "MATERIALIZE bucket:s0:0 id=m stream=dp seg=s0 comm=dp:0-2 meta=float32[20]",
    ),
    (
        Instruction("rs", NodeKind.REDUCE_SCATTER, "dp", value="b", microbatch=0),
        "REDUCE_SCATTER b#0 id=rs stream=dp",
    ),
    # No label: a compute instruction without a segment; a phase OPT that is not an optimizer.
    (Instruction("x", NodeKind.COMPUTE, phase=Phase.F), "id=x kind=compute phase=F"),
    (Instruction("y", NodeKind.COMPUTE, segment="s0", phase=Phase.OPT), "s0:OPT id=y kind=compute"),
    (Instruction("z", NodeKind.SEND, value="a b", peer=1), 'id=z kind=send value="a b" peer=1'),
    (Instruction("e", NodeKind.FREE, meta=TensorMeta((), '"odd"')), 'id=e kind=free meta="\\"odd\\""[]'),
]


@pytest.mark.parametrize(("ins", "text"), EXAMPLES, ids=[t for _, t in EXAMPLES])
def test_examples_print_as_documented(ins: Instruction, text: str) -> None:
    assert format_instruction(ins) == text
    assert parse_instruction(text) == ins
    if '"' not in text:  # spacing between tokens is free (inside a JSON string it is not)
        assert parse_instruction("  " + text.replace(" ", "   ") + "  ") == ins


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("s0:F3", "has no id"),
        ("id=x", "has no kind"),
        ("s0:F3 id=x bogus=1", "unknown field 'bogus'"),
        ("s0:F3 id=x id=y", "field 'id' appears twice"),
        ("id=x s0:F3", "at column 5"),
        ('s0:F3 id="x', "at column 6"),
        ("s0:Q3 id=x", "cannot read the label 's0:Q3'"),
        ("s0:F3 s0:F4 id=x", "cannot read the label"),
        ("SEND v#0 id=x", "cannot read the label 'SEND v#0'"),
        ("SEND v ->1 id=x", "cannot read the label"),
        ("SEND v#0 <-1 id=x", "cannot read the label"),
        ("SEND v#0 ->x id=x", "cannot read the label"),
        ("ALL_REDUCE b# id=x", "cannot read the label"),
        ("ALL_REDUCE b#q id=x", "cannot read the label"),
        ("id=x kind=teleport", "kind=teleport is not a known kind"),
        ("id=x kind=compute phase=Z", "phase=Z is not a known phase"),
        ("id=x kind=compute mb=1.5", "mb=1.5 is not an integer"),
        ("id=x kind=compute meta=float32(1)", "is not dtype[shape]"),
        ("id=x kind=compute waits=a,,b", "cannot read the list"),
        ("id=x kind=compute waits=a,", "cannot read the list"),
        ("id=x kind=compute stream=a\\b", "is not a plain token or a JSON string"),
    ],
)
def test_malformed_instruction_is_refused(text: str, message: str) -> None:
    with pytest.raises(SerializationError, match=re.escape(message)):
        parse_instruction(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("  s0:F0 id=x\n", "line 1: an instruction before the first 'rank' line"),
        ("rank 0\ncommunicator c ranks=[0] traffic=t\n", "line 2: a communicator after the first 'rank' line"),
        ("# ok\nplan 0\n", "line 2: not a comment, communicator, rank or indented instruction line"),
        ("rank 0\n  s0:F0\n", "line 2: instruction 's0:F0' has no id"),
    ],
)
def test_malformed_listing_is_refused(text: str, message: str) -> None:
    with pytest.raises(SerializationError, match=re.escape(message)):
        parse_listing(text)
