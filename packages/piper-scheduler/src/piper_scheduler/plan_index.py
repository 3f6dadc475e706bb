"""One rank's plan indexed for ``verify``'s semantic rules, and what the segments say about
the graph: built once per program, each a pass over the plan (``semantics``).

A rank's compute passes are keyed by (segment, phase, microbatch), its receives by (value,
microbatch); a pass or step that a rank runs twice is refused while indexing (``[once]``),
as is a transfer whose shape or dtype is not its value's, or a bucket operation whose dtype
is not its bucket's (``[shape]``).
"""

from __future__ import annotations

from typing import NoReturn

from piper_ir import Bucket, NodeKind, Phase, Program, RankPlan, SchedulingError, grad_name
from piper_scheduler.diagnostics import describe, excerpts
from piper_scheduler.happens_before import HappensBefore
from piper_scheduler.kinds import COMPUTE, OPTIMIZER, PHASE_B, PHASE_BW, PHASE_F, RECV, SEND

GROUP_KINDS = frozenset({
    NodeKind.ALL_REDUCE, NodeKind.REDUCE_SCATTER, NodeKind.ALL_GATHER, NodeKind.MATERIALIZE, NodeKind.FREE,
    NodeKind.GRAD_NORM,
})

PassKey = tuple[str, Phase, int | None]
"""(segment, phase, microbatch) of a compute pass or an optimizer step (microbatch None)."""


def fail(
    program: Program, rule: str, message: str, slots: list[tuple[int, int]], ranks: list[int] | None = None
) -> NoReturn:
    """Raise the ``SchedulingError`` of a broken rule: ``message [rule]``, the plans around
    ``slots`` (rank, index) marked."""
    plans = program.ranks
    raise SchedulingError(
        f"{message} [{rule}]" + ("\n" + excerpts(program, slots) if slots else ""),
        nodes=[plans[r].instructions[i].id for r, i in slots],
        ranks=sorted(set(ranks if ranks is not None else (r for r, _ in slots))),
    )


def label(key: PassKey) -> str:
    """``s0:B3``, ``s0:OPT``: a pass as instructions print it."""
    seg, phase, mb = key
    return f"{seg}:{phase.value}" + ("" if mb is None else str(mb))


class Tables:
    """What the program's tables say about the graph: per segment the values its forward
    reads from another segment and the outputs whose gradient its backward reads; buckets by
    id, and the (segment, parameter) pairs that hold a tied parameter."""

    def __init__(self, program: Program) -> None:
        batch = frozenset((*program.inputs, *program.targets))
        self.producer: dict[str, str] = {}
        self.readers: dict[str, list[str]] = {}
        for seg in program.segments:
            for v in seg.outputs:
                self.producer.setdefault(v, seg.id)
            for v in dict.fromkeys(seg.inputs):
                self.readers.setdefault(v, []).append(seg.id)
        self.batch = batch
        # gradient name -> the readers of its value, for the SENDs of gradients (their
        # names looked up as they are, not cut back to the value's per send)
        self.grad_readers = {grad_name(v): segs for v, segs in self.readers.items()}
        values = program.value_by_name
        # (value, producer) per input of a segment that another segment produces.
        self.reads = {
            seg.id: [(v, self.producer[v]) for v in dict.fromkeys(seg.inputs) if v not in batch and v in self.producer]
            for seg in program.segments
        }
        self.metas = {v.name: v.meta for v in program.values}
        self.buckets: dict[str, Bucket] = {b.id: b for b in program.buckets}
        self.tied = {holder for tie in program.ties for holder in tie.holders}
        # (gradient name, the segments whose backwards yield it) per output whose gradient
        # flows back: it requires one and a segment reads it (when a training graph has the
        # gradient edge).
        self.grads = {
            seg.id: [(grad_name(v), self.readers[v]) for v in dict.fromkeys(seg.outputs)
                     if v in self.readers and v in values and values[v].meta.requires_grad]
            for seg in program.segments
        }


class RankIndex:
    """One rank's passes, receives, sends and group operations, indexed once."""

    def __init__(self, program: Program, tables: Tables, plan: RankPlan) -> None:
        self.program = program
        self.rank = r = plan.rank
        self.plan = plan
        self.order = HappensBefore(plan)
        self.passes: dict[PassKey, int] = {}
        self.recvs: dict[tuple[str, int], list[int]] = {}
        self.sends: list[int] = []
        self.groups: list[int] = []  # bucket operations and gradient norms
        self.weight_grads: dict[str, list[int]] = {}  # segment -> its B/BW passes here
        passes, metas = self.passes, tables.metas
        for i, ins in enumerate(plan.instructions):
            kind = ins.kind
            if kind is COMPUTE or kind is OPTIMIZER:
                mb = None if kind is OPTIMIZER else (ins.microbatch or 0)
                key = (ins.segment or "", ins.phase or PHASE_F, mb)
                j = passes.setdefault(key, i)
                if j != i:
                    fail(program, "once", f"{describe(program, r, i)} runs {label(key)} a second time on "
                         f"rank {r}: instruction {j} ({plan.instructions[j].id}) runs it already", [(r, j), (r, i)])
                if ins.phase is PHASE_B or ins.phase is PHASE_BW:
                    self.weight_grads.setdefault(key[0], []).append(i)
            elif kind is RECV or kind is SEND:
                if kind is RECV:
                    self.recvs.setdefault((ins.value or "", ins.microbatch or 0), []).append(i)
                else:
                    self.sends.append(i)
                want, have = metas.get(ins.value or ""), ins.meta
                if (have is not want and want is not None and have is not None  # compile shares the value's meta
                        and (have.shape != want.shape or have.dtype != want.dtype)):
                    fail(program, "shape", f"{describe(program, r, i)} moves {list(have.shape)}/{have.dtype} but "
                         f"value {ins.value} is {list(want.shape)}/{want.dtype}", [(r, i)])
            elif kind in GROUP_KINDS:
                self.groups.append(i)
                bucket = tables.buckets.get(ins.value or "")
                if bucket is not None and ins.meta is not None and ins.meta.dtype != bucket.dtype:
                    fail(program, "shape", f"{describe(program, r, i)} moves {ins.meta.dtype} but bucket {bucket.id} "
                         f"holds {bucket.dtype}", [(r, i)])

    def need(self, consumer: int, value: str, mb: int, sources: list[int]) -> None:
        """``consumer`` reads ``value`` of ``mb``: ``sources`` (what yields it here) exist and
        precede it."""
        if not sources:
            fail(self.program, "dataflow", f"{describe(self.program, self.rank, consumer)} reads {value}#{mb}, "
                 f"which rank {self.rank} neither computes nor receives", [(self.rank, consumer)])
        precedes = self.order.precedes
        for j in sources:
            if not precedes(j, consumer):
                self.fail_order("dataflow", j, consumer, f"which yields the {value}#{mb} it reads")

    def after(self, rule: str, first: int, then: int, why: str) -> None:
        """Fail unless instruction ``first`` precedes ``then`` on this rank."""
        if not self.order.precedes(first, then):
            self.fail_order(rule, first, then, why)

    def fail_order(self, rule: str, first: int, then: int, why: str) -> NoReturn:
        fail(self.program, rule, f"{describe(self.program, self.rank, then)} runs before instruction {first} "
             f"({self.plan.instructions[first].id}), {why}", [(self.rank, then), (self.rank, first)])


