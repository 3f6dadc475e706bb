"""A text form of compiled plans that parses back: one line per instruction.

An instruction prints as its ``short()`` label, the notation of torch's pipelining actions
extended to our kinds (``s0:F3``, ``s1:BW0``, ``SEND v:s0#3 ->1``, ``RECV grad:v:s1#0 <-1``,
``REDUCE_SCATTER bucket:s0:0#2``, ``MATERIALIZE bucket:s0:0``), then ``key=value`` fields for
everything the label does not say, in a fixed order and only where they differ from what the
label implies or from the field's default::

    SEND v:s0#0 ->1 id=send.v:s0.mb0.0-1 stream=pp comm=pp.fwd meta=float32[1,4]/b0/g waits=ev.F.s0.mb0

``parse_instruction(format_instruction(x)) == x`` for every instruction: the printer checks
what the label implies and spells out any field it gets wrong, and a string that is not a
plain token (letters, digits, ``_.:/@+-``) is written as a JSON string literal. An
instruction whose label cannot say its fields (no segment, say) prints fields only.

A *listing* is a program's communicators and rank plans, a line each, with ``#`` comment
lines; golden-plan files are listings (``format_listing``, ``parse_listing``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import attrs

from piper_ir.errors import SerializationError
from piper_ir.graph import COMPUTE_KINDS, POINT_TO_POINT_KINDS, NodeKind, TensorMeta
from piper_ir.program import Communicator, Instruction, Program, RankPlan
from piper_ir.tags import Phase

_BARE = re.compile(r"[A-Za-z0-9_.:/@+\-]+")
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_FIELD = re.compile(rf"([a-z]+)=((?:{_QUOTED}|[^\s\"])+)(?=\s|$)")
_WORD = re.compile(r"[^\s\"=]+(?=\s|$)")
_INT = re.compile(r"-?\d+")
_COMPUTE_HEAD = re.compile(r"(?P<seg>.+):(?P<phase>F|B|BI|BW|OPT)(?P<mb>-?\d+)?")
_DTYPE = re.compile(r"[A-Za-z0-9_]+")
_META = re.compile(rf"(?P<dtype>{_QUOTED}|[A-Za-z0-9_]+)\[(?P<shape>-?\d+(?:,-?\d+)*)?\](?P<bd>/b-?\d+)?(?P<g>/g)?")
_ITEM = re.compile(rf"({_QUOTED}|[^,\"\s]+)(,|$)")
_LABELS = {k.value.upper(): k for k in NodeKind if k not in COMPUTE_KINDS}
_ARROWS = {NodeKind.SEND: "->", NodeKind.RECV: "<-"}

# Instruction field -> key in the text form. ``test_text`` fails when Instruction gains a
# field that is not listed here, so the text form cannot silently drop one.
FIELD_KEYS = {
    "id": "id",
    "kind": "kind",
    "stream": "stream",
    "segment": "seg",
    "phase": "phase",
    "microbatch": "mb",
    "value": "value",
    "peer": "peer",
    "communicator": "comm",
    "meta": "meta",
    "waits": "waits",
    "record": "record",
    "overlap": "overlap",
}
_FIELD_OF = {key: name for name, key in FIELD_KEYS.items()}
_DEFAULTS = {f.name: f.default for f in attrs.fields(Instruction) if f.default is not attrs.NOTHING}


def format_instruction(ins: Instruction) -> str:
    """The one-line text form of ``ins`` (module doc); ``parse_instruction`` reads it back."""
    head, fields = _parts(ins)
    return " ".join([*head, *fields])


def parse_instruction(text: str) -> Instruction:
    """The instruction ``format_instruction`` printed as ``text``; ``SerializationError`` if
    ``text`` is not such a line."""
    head, fields = _tokens(text)
    values = {**_parse_head(head, text)}
    for key, raw in fields.items():
        name = _FIELD_OF.get(key)
        if name is None:
            raise SerializationError(f"unknown field {key!r} in instruction {text!r}")
        values[name] = _decode(name, raw, text)
    for name in ("id", "kind"):
        if name not in values:
            raise SerializationError(f"instruction {text!r} has no {FIELD_KEYS[name]}")
    return Instruction(**values)


def _parts(ins: Instruction) -> tuple[list[str], list[str]]:
    head = _head(ins)
    implied = {**_DEFAULTS, **_parse_head(head, "")}
    fields = []
    for name, key in FIELD_KEYS.items():
        value = getattr(ins, name)
        # The label and the defaults imply every field but ``id`` and (without a label)
        # ``kind``; a None field is always a default here, since the label says only
        # fields that are set.
        if name != "id" and name in implied and implied[name] == value:
            continue
        fields.append(f"{key}={_encode(name, value)}")
    return head, fields


def _head(ins: Instruction) -> list[str]:
    """``ins.short()`` as tokens, or nothing where the label cannot carry its fields."""
    mb = "" if ins.microbatch is None else str(ins.microbatch)
    if ins.kind in COMPUTE_KINDS:
        if ins.segment is None or ins.phase is None or not _BARE.fullmatch(ins.segment):
            return []
        return [f"{ins.segment}:{ins.phase.value}{mb}"]
    if ins.value is None or not _BARE.fullmatch(ins.value):
        return []
    label = ins.kind.value.upper()
    if ins.kind in POINT_TO_POINT_KINDS:
        if ins.peer is None:
            return []
        return [label, f"{ins.value}#{mb}", f"{_ARROWS[ins.kind]}{ins.peer}"]
    return [label, ins.value + (f"#{mb}" if mb else "")]


def _parse_head(tokens: list[str], text: str) -> dict[str, object]:
    if not tokens:
        return {}
    kind = _LABELS.get(tokens[0])
    if kind is None:
        m = _COMPUTE_HEAD.fullmatch(tokens[0])
        if len(tokens) != 1 or m is None or not _BARE.fullmatch(m["seg"]):
            raise SerializationError(f"cannot read the label {' '.join(tokens)!r} of instruction {text!r}")
        phase = Phase(m["phase"])
        return {
            "kind": NodeKind.OPTIMIZER if phase is Phase.OPT else NodeKind.COMPUTE,
            "segment": m["seg"],
            "phase": phase,
            "microbatch": None if m["mb"] is None else int(m["mb"]),
        }
    p2p = kind in POINT_TO_POINT_KINDS
    bad = SerializationError(f"cannot read the label {' '.join(tokens)!r} of instruction {text!r}")
    if len(tokens) != (3 if p2p else 2):
        raise bad
    value, hashed, mb = tokens[1].rpartition("#")
    if not hashed:
        value, mb = tokens[1], ""
    # A transfer always prints '#' (then its microbatch, if any); a bucket operation prints
    # '#<microbatch>' only when it has one.
    if (p2p and not hashed) or (not p2p and hashed and not mb):
        raise bad
    if not _BARE.fullmatch(value) or (mb and not _INT.fullmatch(mb)):
        raise bad
    out: dict[str, object] = {"kind": kind, "value": value, "microbatch": int(mb) if mb else None}
    if p2p:
        arrow, peer = tokens[2][:2], tokens[2][2:]
        if arrow != _ARROWS[kind] or not _INT.fullmatch(peer):
            raise bad
        out["peer"] = int(peer)
    return out


def _tokens(text: str) -> tuple[list[str], dict[str, str]]:
    """The label's tokens, then the ``key=value`` fields (which must come after it)."""
    head: list[str] = []
    fields: dict[str, str] = {}
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return head, fields
        m = _FIELD.match(text, pos)
        if m is not None:
            if m[1] in fields:
                raise SerializationError(f"field {m[1]!r} appears twice in instruction {text!r}")
            fields[m[1]] = m[2]
        else:
            m = _WORD.match(text, pos)
            if m is None or fields:
                raise SerializationError(f"cannot read instruction {text!r} at column {pos}")
            head.append(m[0])
        pos = m.end()


def _str(value: str) -> str:
    return value if _BARE.fullmatch(value) else json.dumps(value)


def _unstr(raw: str, text: str) -> str:
    if raw.startswith('"'):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, str):
            return value
    elif _BARE.fullmatch(raw):
        return raw
    raise SerializationError(f"{raw!r} is not a plain token or a JSON string, in {text!r}")


def _encode(name: str, value: object) -> str:
    if name in ("kind", "phase"):
        return value.value  # type: ignore[attr-defined]
    if name in ("microbatch", "peer", "overlap"):
        return str(value)
    if name == "meta":
        return _encode_meta(value)  # type: ignore[arg-type]
    if name == "waits":
        return ",".join(_str(w) for w in value)  # type: ignore[attr-defined]
    return _str(value)  # type: ignore[arg-type]


def _decode(name: str, raw: str, text: str) -> object:
    try:
        if name == "kind":
            return NodeKind(raw)
        if name == "phase":
            return Phase(raw)
    except ValueError:
        raise SerializationError(f"{FIELD_KEYS[name]}={raw} is not a known {name}, in {text!r}") from None
    if name in ("microbatch", "peer", "overlap"):
        if not _INT.fullmatch(raw):
            raise SerializationError(f"{FIELD_KEYS[name]}={raw} is not an integer, in {text!r}")
        return int(raw)
    if name == "meta":
        return _decode_meta(raw, text)
    if name == "waits":
        return tuple(_unstr(item, text) for item in _items(raw, text))
    return _unstr(raw, text)


def _items(raw: str, text: str) -> list[str]:
    items, pos = [], 0
    while pos < len(raw):
        m = _ITEM.match(raw, pos)
        if m is None or (m[2] == "," and m.end() == len(raw)):
            raise SerializationError(f"cannot read the list {raw!r} in {text!r}")
        items.append(m[1])
        pos = m.end()
    return items


def _encode_meta(meta: TensorMeta) -> str:
    dtype = meta.dtype if _DTYPE.fullmatch(meta.dtype) else json.dumps(meta.dtype)
    out = f"{dtype}[{','.join(map(str, meta.shape))}]"
    if meta.batch_dim is not None:
        out += f"/b{meta.batch_dim}"
    return out + ("/g" if meta.requires_grad else "")


def _decode_meta(raw: str, text: str) -> TensorMeta:
    m = _META.fullmatch(raw)
    if m is None:
        raise SerializationError(f"meta={raw} is not dtype[shape][/b<dim>][/g], in {text!r}")
    dtype = _unstr(m["dtype"], text) if m["dtype"].startswith('"') else m["dtype"]
    shape = tuple(int(d) for d in m["shape"].split(",")) if m["shape"] else ()
    batch_dim = int(m["bd"][2:]) if m["bd"] else None
    return TensorMeta(shape, dtype, batch_dim, m["g"] is not None)


@attrs.frozen
class Listing:
    """What a compiled plan decides, as a listing holds it: the communicators and each
    rank's instructions (``Listing.of(program)``)."""

    communicators: tuple[Communicator, ...] = attrs.field(converter=tuple)
    ranks: tuple[RankPlan, ...] = attrs.field(converter=tuple)

    @classmethod
    def of(cls, program: Program) -> Listing:
        return cls(program.communicators, program.ranks)


def format_listing(plans: Program | Listing, comments: Iterable[str] = ()) -> str:
    """A program's communicators and rank plans, one line each, after ``# comment`` lines.

    ``communicator <id> ranks=[0,1] traffic=<traffic>``, then per rank ``rank <r>`` (with
    ``replica=<j>`` for a data-parallel replica other than 0) and its instructions indented,
    labels padded to one column so a rank reads like torch's action lists."""
    listing = Listing.of(plans) if isinstance(plans, Program) else plans
    lines = [f"# {c}".rstrip() for c in comments]
    for comm in listing.communicators:
        ranks = ",".join(map(str, comm.ranks))
        lines.append(f"communicator {_str(comm.id)} ranks=[{ranks}] traffic={_str(comm.traffic)}")
    for plan in listing.ranks:
        lines.append(f"rank {plan.rank}" + (f" replica={plan.replica}" if plan.replica else ""))
        parts = [_parts(ins) for ins in plan.instructions]
        width = max((len(" ".join(head)) for head, _ in parts), default=0)
        for head, fields in parts:
            label = " ".join(head)
            lines.append(f"  {label:<{width}} {' '.join(fields)}".rstrip() if label else f"  {' '.join(fields)}")
    return "\n".join(lines) + "\n"


_COMM_LINE = re.compile(rf"communicator ({_QUOTED}|\S+) ranks=\[((?:-?\d+(?:,-?\d+)*)?)\] traffic=({_QUOTED}|\S+)")
_RANK_LINE = re.compile(r"rank (\d+)(?: replica=(\d+))?")


def parse_listing(text: str) -> Listing:
    """The communicators and rank plans of a ``format_listing`` text (comments skipped);
    ``SerializationError`` naming the line number on anything else."""
    comms: list[Communicator] = []
    ranks: list[tuple[int, int, list[Instruction]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            if line[0].isspace():
                if not ranks:
                    raise SerializationError("an instruction before the first 'rank' line")
                ranks[-1][2].append(parse_instruction(stripped))
            elif m := _COMM_LINE.fullmatch(stripped):
                if ranks:
                    raise SerializationError("a communicator after the first 'rank' line")
                members = tuple(int(r) for r in m[2].split(",")) if m[2] else ()
                comms.append(Communicator(_unstr(m[1], line), members, _unstr(m[3], line)))
            elif m := _RANK_LINE.fullmatch(stripped):
                ranks.append((int(m[1]), int(m[2] or 0), []))
            else:
                raise SerializationError("not a comment, communicator, rank or indented instruction line")
        except SerializationError as err:
            raise SerializationError(f"line {number}: {err.message}") from None
    return Listing(comms, [RankPlan(r, ins, replica) for r, replica, ins in ranks])
