"""The compiled plan: what each rank executes, stream by stream.

A ``Program`` is the only type a runtime needs. Each rank holds one instruction list in a
valid sequential order; an instruction's ``stream`` says which logical stream it belongs to
(the per-stream orders are the sub-sequences), ``waits`` names the events recorded by other
streams that must complete first and ``record`` the event it records. A sequential runtime
walks the list; a threaded runtime runs each stream on its own worker and honours events.
"""

from __future__ import annotations

from functools import cached_property

import attrs

from piper_ir.graph import (
    Bucket,
    GradNorm,
    NodeKind,
    Precision,
    Replication,
    Segment,
    Sharding,
    TensorMeta,
    Tie,
    Value,
)
from piper_ir.tags import Phase

PROGRAM_FORMAT_VERSION = 1
# The kinds ``RankPlan.segments`` counts, as one set: ``NodeKind.COMPUTE`` read per instruction
# goes through the enum's descriptor (392k instructions at 16,384 devices: 0.045 -> 0.014 s)
_PASS_KINDS = frozenset({NodeKind.COMPUTE, NodeKind.OPTIMIZER})


@attrs.frozen
class Instruction:
    """One step of one rank's plan.

    Compute: ``segment`` + ``phase`` + ``microbatch``. ``SEND``/``RECV``: ``value`` (the
    activation, or ``grad:<value>`` for its gradient) for ``microbatch``, to/from ``peer`` on
    ``communicator``, with ``meta`` giving the exact shape and dtype that travel.
    ``overlap``: compute instructions of one rank with the same number come from one
    ``Order`` slot that holds a forward and a backward chunk (DualPipe's overlapped F&B);
    ``None`` otherwise. A runtime may ignore it; the simulator can charge such a pair less.
    """

    id: str
    kind: NodeKind
    stream: str = "compute"
    segment: str | None = None
    phase: Phase | None = None
    microbatch: int | None = None
    value: str | None = None
    peer: int | None = None
    communicator: str | None = None
    meta: TensorMeta | None = None
    waits: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    record: str | None = None
    overlap: int | None = None

    def short(self) -> str:
        """A compact label in the style of torch's schedule actions (``1F3``, ``SEND a->1``)."""
        mb = "" if self.microbatch is None else str(self.microbatch)
        if self.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER):
            return f"{self.segment}:{self.phase.value if self.phase else '?'}{mb}"
        if self.kind is NodeKind.GRAD_NORM:
            return "GRAD_NORM"
        if self.kind not in (NodeKind.SEND, NodeKind.RECV):  # group operations on a bucket
            return f"{self.kind.value.upper()} {self.value}" + (f"#{mb}" if mb else "")
        arrow = "->" if self.kind is NodeKind.SEND else "<-"
        return f"{self.kind.value.upper()} {self.value}#{mb} {arrow}{self.peer}"

    def text(self) -> str:
        """The full one-line form, which parses back (``Instruction.parse``): ``short()``
        then ``key=value`` for every field the label does not say (``piper_ir.text``)."""
        from piper_ir.text import format_instruction  # piper_ir.text imports this module

        return format_instruction(self)

    @classmethod
    def parse(cls, text: str) -> Instruction:
        """The instruction whose ``text()`` is ``text``; ``SerializationError`` otherwise."""
        from piper_ir.text import parse_instruction

        return parse_instruction(text)


@attrs.frozen
class RankPlan:
    """One rank's instructions. ``replica`` is this rank's index in the device groups it
    belongs to: with data parallelism, replica ``j`` reads shard ``j`` of each microbatch."""

    rank: int
    instructions: tuple[Instruction, ...] = attrs.field(converter=tuple)
    replica: int = 0

    def streams(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for ins in self.instructions:
            seen.setdefault(ins.stream, None)
        return tuple(seen)

    def stream_order(self, stream: str) -> list[Instruction]:
        return [ins for ins in self.instructions if ins.stream == stream]

    def segments(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for ins in self.instructions:
            if ins.segment is not None and ins.kind in _PASS_KINDS:
                seen.setdefault(ins.segment, None)
        return tuple(seen)


@attrs.frozen
class Communicator:
    """A group of ranks that exchange one class of traffic (e.g. ``pp.fwd``)."""

    id: str
    ranks: tuple[int, ...] = attrs.field(converter=tuple)
    traffic: str


def _non_negative(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be a non-negative int, got {value!r}")


@attrs.frozen
class ExecutionOptions:
    """How a runtime may run ahead of the plan, where that costs memory: a parameter of the
    program, so the runtime obeys it and the memory estimate reads it (no copied constants).

    ``recv_lookahead``: receive buffers posted beyond the receive being waited for (the
    receives of the next ``recv_lookahead`` ``RECV`` instructions are in flight, so data
    moves before the compute that needs it comes up). ``reduce_scatters_in_flight``: early
    reduce-scatters (``Bucket.grads_home`` sharded) a weight-gradient pass may leave running
    before it waits for the oldest.
    """

    recv_lookahead: int = attrs.field(default=2, validator=_non_negative)
    reduce_scatters_in_flight: int = attrs.field(default=2, validator=_non_negative)


@attrs.frozen(eq=True)
class Program:
    """Per-rank plans plus everything a runtime must know to execute them."""

    world_size: int
    ranks: tuple[RankPlan, ...] = attrs.field(converter=tuple)
    communicators: tuple[Communicator, ...] = attrs.field(converter=tuple)
    segments: tuple[Segment, ...] = attrs.field(converter=tuple)
    values: tuple[Value, ...] = attrs.field(converter=tuple)
    inputs: tuple[str, ...] = attrs.field(converter=tuple)
    targets: tuple[str, ...] = attrs.field(converter=tuple)
    microbatches: int = 1
    placement: tuple[tuple[str, tuple[int, ...]], ...] = attrs.field(default=(), converter=tuple)
    """Which devices hold each segment's parameters (segment id -> device group)."""
    replicas: int = 1
    """Data-parallel degree: every batch microbatch is split into this many shards."""
    replication: tuple[Replication, ...] = attrs.field(default=(), converter=tuple)
    buckets: tuple[Bucket, ...] = attrs.field(default=(), converter=tuple)
    sharding: tuple[Sharding, ...] = attrs.field(default=(), converter=tuple)
    """Tensor-parallel segments: how their parameters are cut over their device group."""
    execution: ExecutionOptions = ExecutionOptions()
    """How far a runtime may run ahead of the plan (memory it may spend doing so)."""
    ties: tuple[Tie, ...] = attrs.field(default=(), converter=tuple)
    """Parameters held by several segments (``Graph.ties``): a rank holding several holders
    keeps one tensor for them, stepped by the first holder's optimizer there; the tie buckets
    and reductions that sum their gradients are ordinary buckets and instructions."""
    precision: Precision | None = None
    """Compute and master dtypes (``Graph.precision``); ``None``: segments run in their
    parameters' own dtypes."""
    grad_norm: GradNorm | None = None
    """What the ``GRAD_NORM`` instructions count and whether they clip (``None``: no norm)."""

    @cached_property
    def segment_by_id(self) -> dict[str, Segment]:
        return {s.id: s for s in self.segments}

    @cached_property
    def value_by_name(self) -> dict[str, Value]:
        return {v.name: v for v in self.values}

    def plan(self, rank: int) -> RankPlan:
        return self.ranks[rank]

    def devices_of(self, segment: str) -> tuple[int, ...]:
        return dict(self.placement)[segment]
