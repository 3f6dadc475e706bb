"""The cost model the simulator charges instructions with (abstract time units), and
``CostModel.parse`` for its text form (``F=1,B=2,W=1,FB=2.5,loss=0``)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from piper_ir import Phase, TensorMeta

Overrides = tuple[tuple[str, Phase, float], ...]
PAIR_MODELS = ("halves", "atomic")

# Text keys -> fields; W is the usual name of the weight half of a split backward.
_KEYS = {"F": "F", "B": "B", "BI": "BI", "BW": "BW", "W": "BW", "OPT": "OPT", "FB": "FB", "loss": "loss"}
_TOLERANCE = 1e-9


def _overrides(value: Mapping[str, Mapping[str, float]] | Overrides) -> Overrides:
    if isinstance(value, Mapping):
        items = [(seg, Phase(ph), float(c)) for seg, costs in value.items() for ph, c in costs.items()]
    else:
        items = [(seg, Phase(ph), float(c)) for seg, ph, c in value]
    return tuple(sorted(items))


@attrs.frozen
class CostModel:
    """Per-phase compute costs, per-segment overrides and a latency/bandwidth link model.

    ``overrides`` maps segment id -> phase -> cost (``{"loss": {"F": 0, "B": 0}}``); it is
    stored as sorted ``(segment, phase, cost)`` triples so the model stays hashable. A transfer
    of ``n`` bytes costs ``latency + n / bandwidth``; by default communication is free.

    ``FB`` is the time of an overlapped forward + backward pair (DualPipe's F&B, between
    ``max(F, B)`` and ``F + B``): the compute of an overlapped slot (``Instruction.overlap``)
    is charged ``FB / (F + B)`` of its cost, so a pair whose halves cost F and B occupies its
    stream for FB. ``None`` (the default) runs the two halves back to back at full cost.
    ``pairs`` says when a pair's outputs appear (docs/schedules.md derives both bubbles):

    - ``"halves"`` (default): each half as soon as it is done, but never earlier than it would
      be alone from the pair's start (the forward half at start + F, the backward half at
      start + B at the earliest); the stream takes nothing else until both are;
    - ``"atomic"``: the pair starts when every member's inputs are there and all its outputs
      appear at its end, as in DeepSeek's DualPipe table and implementation (both chunks'
      sends after the overlapped compute).

    ``overhead`` is added to every compute instruction (the executor's dispatch cost), and
    ``comm_overhead`` to every SEND/RECV/collective (posting and completing a message);
    ``startup`` is when every stream may begin (a runtime's per-step set-up, such as
    splitting the batch into microbatches).
    """

    F: float = 1.0
    B: float = 2.0
    BI: float = 1.0
    BW: float = 1.0
    OPT: float = 0.0
    overrides: Overrides = attrs.field(default=(), converter=_overrides)
    latency: float = 0.0
    bandwidth: float = math.inf
    FB: float | None = None
    overhead: float = 0.0
    comm_overhead: float = 0.0
    startup: float = 0.0
    pairs: str = attrs.field(default="halves", validator=attrs.validators.in_(PAIR_MODELS))

    @classmethod
    def parse(cls, text: str, *, source: str = "cost model") -> CostModel:
        """The model that ``F=1,B=2,W=1[,BI=..][,OPT=..][,FB=..][,loss=..]`` describes.

        Keys: ``F``, ``B`` (a full backward), ``BI`` and ``BW`` (or ``W``; the halves of a
        split backward), ``OPT``, ``FB`` (an overlapped F&B pair) and ``loss`` (the loss
        segment's cost in every phase, 0 unless given). A backward is one quantity, so
        ``B = BI + BW`` always holds: given two of them the third is derived (``F=1,B=3,W=1``
        gives ``BI=2``); ``B`` alone is split in halves; ``BI`` or ``BW`` alone, all three
        disagreeing, a derived half below zero, or ``FB`` outside ``[max(F, B), F + B]`` is a
        ``ValueError`` that names the keys. Unknown keys, repeated keys (``W`` and ``BW`` are
        one key) and values that are not numbers >= 0 are errors too. ``source`` starts
        every message (``"--cost"`` on the command line).
        """
        given: dict[str, float] = {}
        spelled: dict[str, str] = {}  # field -> the key as written (W or BW)
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = (part.strip() for part in item.partition("="))
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if not sep or key not in _KEYS or not value >= 0 or math.isinf(value):
                raise ValueError(
                    f"{source}: expected KEY=NUMBER (a number >= 0) with KEY in F, B, BI, BW (or W), OPT, FB, "
                    f"loss; got {item!r}"
                )
            field = _KEYS[key]
            if field in given:
                raise ValueError(f"{source}: {spelled[field]} and {key} both give {field}; give it once")
            given[field], spelled[field] = value, key
        default = cls()
        name = {f: spelled.get(f, f) for f in ("B", "BI", "BW")}
        b, bi, bw = (given.get(f) for f in ("B", "BI", "BW"))
        if b is None and bi is None and bw is None:
            b, bi, bw = default.B, default.BI, default.BW
        elif bi is None and bw is None:
            bi = bw = b / 2  # type: ignore[operator]
        elif b is None:
            if bi is None or bw is None:
                half, other = (name["BI"], name["BW"]) if bi is not None else (name["BW"], name["BI"])
                raise ValueError(f"{source}: {half} alone does not say the whole backward; give B or {other} too")
            b = bi + bw
        elif bi is None or bw is None:
            known, missing = ("BW", "BI") if bi is None else ("BI", "BW")
            derived = b - given[known]
            if derived < -_TOLERANCE:
                raise ValueError(
                    f"{source}: {missing} = B - {name[known]} = {b:g} - {given[known]:g} is negative; "
                    f"{name[known]} must not exceed B"
                )
            bi, bw = (max(derived, 0.0), given[known]) if missing == "BI" else (given[known], max(derived, 0.0))
        elif abs(b - (bi + bw)) > _TOLERANCE * max(1.0, b):
            raise ValueError(
                f"{source}: B = {b:g} but {name['BI']} + {name['BW']} = {bi:g} + {bw:g} = {bi + bw:g}; "
                "a backward is its two halves (B = BI + BW)"
            )
        f = given.get("F", default.F)
        fb = given.get("FB")
        if fb is not None and not max(f, b) - _TOLERANCE <= fb <= f + b + _TOLERANCE:
            raise ValueError(
                f"{source}: FB = {fb:g} must lie in [max(F, B), F + B] = [{max(f, b):g}, {f + b:g}]: an overlapped "
                "pair takes at least its longer half and at most both halves back to back"
            )
        loss = given.get("loss", 0.0)
        return cls(
            F=f,
            B=b,
            BI=bi,
            BW=bw,
            OPT=given.get("OPT", default.OPT),
            FB=fb,
            overrides={"loss": {"F": loss, "B": loss, "BI": loss, "BW": loss}},
        )

    def overlap_factor(self) -> float:
        """What an instruction of an overlapped slot pays per unit of its own cost."""
        if self.FB is None or self.F + self.B <= 0:
            return 1.0
        return self.FB / (self.F + self.B)

    def compute_cost(self, segment: str | None, phase: Phase | None) -> float:
        """The duration of ``segment``'s ``phase`` (0 for an instruction without a phase)."""
        if phase is None:
            return 0.0
        for seg, ph, cost in self.overrides:
            if seg == segment and ph is phase:
                return cost
        return float(getattr(self, phase.value))

    def comm_cost(self, meta: TensorMeta | None) -> float:
        """The duration of one transfer (or collective) of a tensor described by ``meta``."""
        nbytes = meta.nbytes() if meta is not None else 0
        return self.latency + (nbytes / self.bandwidth if nbytes else 0.0)
