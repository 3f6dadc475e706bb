"""The cost model the simulator charges instructions with (abstract time units), and
``CostModel.parse`` for its text form (``F=1,B=2,W=1,FB=2.5,loss=0``).

``sharded_collectives`` prices the collectives a sharded segment issues inside its own
compute (tensor parallelism's all-reduces, sequence parallelism's reduce-scatters and
all-gathers, context parallelism's key/value gathers, a vocabulary-parallel loss's
all-reduce) on a ring ``Link``, as ``CostModel.collectives``; compute times measured on the
runtime hold them already (``piper tune``'s profiles) and are given without them."""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from piper_ir import Phase, Program, SegmentRole, ShardKind, TensorMeta
from piper_scheduler.analytic import Link

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

    ``collectives`` maps segment id -> phase -> the time one instruction of that phase spends
    in the collectives its segment issues inside its compute (``sharded_collectives``),
    charged on top of its compute cost (as ``overrides``, stored as sorted triples).

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
    collectives: Overrides = attrs.field(default=(), converter=_overrides)

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

    def collective_cost(self, segment: str | None, phase: Phase | None) -> float:
        """The time ``segment``'s ``phase`` spends in its own collectives (0 unless given)."""
        for seg, ph, cost in self.collectives:
            if seg == segment and ph is phase:
                return cost
        return 0.0

    def comm_cost(self, meta: TensorMeta | None) -> float:
        """The duration of one transfer (or collective) of a tensor described by ``meta``."""
        nbytes = meta.nbytes() if meta is not None else 0
        return self.latency + (nbytes / self.bandwidth if nbytes else 0.0)


def sharded_collectives(program: Program, link: Link) -> dict[str, dict[str, float]]:
    """Segment id -> phase -> seconds of the collectives one instruction of that sharded
    segment issues, ring algorithms over ``link`` among its group's ``degree`` ranks, from the
    IR alone. Each moves the segment's stream (its largest floating-point input, else output:
    one microbatch's hidden states on one rank); ``AR`` is an all-reduce of it, ``AG`` an
    all-gather or reduce-scatter (half an ``AR``'s time):

    - ``tp`` (piper_directives.shard_code): ``Sharding.collectives`` counts one forward's, one
      per row Linear (a ``ParamShard`` on dimension 1), one for a vocabulary-cut embedding and
      one for a vocabulary-cut head (the segment whose output a vocabulary-parallel loss
      reads). ``F``: an ``AR`` per row and per embedding; ``B``/``BI``: an ``AR`` per row (its
      column group's input gradient) and for the head's input; ``BW`` none;
    - ``tp`` with ``sequence_parallel`` (piper_directives.shard_sequence): each row's ``AR``
      becomes a reduce-scatter and its column group's input an all-gather (the same time); the
      backward gathers each column group's input again (one more ``AG`` per row); the
      embedding's reduces-scatters (``AG`` forward and backward), the head's input is
      gathered (``AG`` forward, ``AG`` backward); each activation input is narrowed (an ``AG``
      of its gradient in the backward), each activation output but the logits gathered (an
      ``AG`` forward);
    - ``tp`` on the loss segment (a vocabulary-parallel cross-entropy): one all-reduce in the
      forward of every token's per-rank log-sum-exp slots and target logit (``degree + 1``
      fp32 numbers a token), none in the backward;
    - ``cp`` (piper_directives.context_code): ``Sharding.collectives`` all-gathers of keys or
      values along the sequence in the forward, whose whole is ``degree`` times the rank's
      chunk of the stream (exact where they are as wide as the stream, as when grouped
      key/value heads are repeated before attention; an upper bound where they are not), and
      as many reduce-scatters of their gradients in the backward;
    - ``ep`` (all-to-alls of routed tokens): not priced here.

    Not in the IR, so not priced: the backward all-reduces of key/value projections a TP
    degree does not divide (kept whole, each rank narrowing them) and SP's small all-reduces
    of the norm weights' gradients. Use it only with compute times that do not hold the
    collectives already (measured ones do; benchmarks/bench_sharded_memory.py holds it
    against counted bytes)."""
    values = program.value_by_name
    heads = _vocabulary_heads(program)
    out: dict[str, dict[str, float]] = {}
    for sh in program.sharding:
        if not sh.collectives or sh.degree < 2 or sh.kind is ShardKind.EP:
            continue
        seg = program.segment_by_id[sh.segment]
        n = sh.degree
        if seg.role is SegmentRole.LOSS:
            if sh.kind is not ShardKind.TP:
                continue
            tokens = max((values[t].meta.numel() for t in program.targets if t in values), default=0)
            forward = sh.collectives * link.all_reduce((n + 1) * tokens * 4, n)
            out[seg.id] = {"F": forward, "B": 0.0, "BI": 0.0, "BW": 0.0}
            continue
        stream = _stream_bytes(program, seg.inputs) or _stream_bytes(program, seg.outputs)
        ag, ar = link.all_gather(stream, n), link.all_reduce(stream, n)
        if sh.kind is ShardKind.CP:
            forward = backward = sh.collectives * link.all_gather(stream * n, n)
        else:
            rows = sum(1 for p in sh.params if p.dim == 1 and not p.experts)
            head = 1 if seg.id in heads else 0
            embedding = max(sh.collectives - rows - head, 0)
            if not sh.sequence_parallel:
                forward, backward = (rows + embedding) * ar, (rows + head) * ar
            else:
                grads = [v for v in seg.inputs if v in values and values[v].meta.requires_grad]
                gathered = [v for v in seg.outputs if v in values and values[v].meta.requires_grad and not head]
                forward = rows * ar + (embedding + head + len(gathered)) * ag
                backward = rows * (ar + ag) + (embedding + head + len(grads)) * ag
        out[seg.id] = {"F": forward, "B": backward, "BI": backward, "BW": 0.0}
    return out


def _vocabulary_heads(program: Program) -> set[str]:
    """The segments whose outputs a vocabulary-parallel loss reads (their logits are cut)."""
    loss = {sh.segment for sh in program.sharding
            if sh.kind is ShardKind.TP and sh.collectives and sh.degree > 1
            and program.segment_by_id[sh.segment].role is SegmentRole.LOSS}
    read = {v for seg_id in loss for v in program.segment_by_id[seg_id].inputs}
    return {seg.id for seg in program.segments if seg.id not in loss and read & set(seg.outputs)}


def _stream_bytes(program: Program, names: tuple[str, ...]) -> int:
    """The bytes of the largest floating-point value among ``names`` (0: none)."""
    values = program.value_by_name
    sizes = [values[n].meta.nbytes() for n in names
             if n in values and values[n].meta.dtype.startswith(("float", "bfloat"))]
    return max(sizes, default=0)
