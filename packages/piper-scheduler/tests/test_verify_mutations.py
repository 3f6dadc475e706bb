"""Property: a valid plan, mutated at random, is refused by ``verify`` or is harmless.

Mutations (one per example, on one of several compiled plans: 1F1B, ZB1P's split backward,
interleaved 1F1B, DualPipe's mirrored replicas, data parallelism with ZeRO-2 and a gradient
norm, ZB1P with ZeRO-3, a ZeRO-3 evaluation program): drop an instruction, duplicate one
(fresh id), swap two on a rank, move an optimizer step earlier, relabel the microbatch of a
pass or a transfer (one end, or both ends of a message), change the shape a transfer moves
(one end, or both ends). ``PIPER_HYPOTHESIS_EXAMPLES`` raises the count (30,000 pass).

*Harmless* means: the mutated plan, run by ``execute`` below, observes exactly what the
original observes. ``execute`` is an oracle independent of ``verify``: it runs the plan as
the sequential runtime does (each rank walks its list; a RECV blocks until its channel holds
a message, matched in order; a collective until every member of its communicator reaches
its next one) on symbolic values. Each pass yields a term naming the pass and the terms of
everything it read: inputs of its microbatch (batch data of the rank's replica, or what a
forward or a RECV left for that value and microbatch), the gradients accumulated for its
outputs, its own forward (a backward) or input half (``BW``), the ZeRO-3 buckets gathered
at the time. A reduction's term names every member's gradients at the time; a step's term
the gradients and the norm it steps with. The observations are every loss forward, step,
gradient norm and all-gather, per rank, as a multiset (sums are taken in exact arithmetic:
summing gradients in another order is harmless), or a deadlock. So a mutation is harmless
exactly when every step, loss and norm is computed from the same inputs as before; what
only changes memory (dropping a ``FREE``) or the order of independent work is harmless,
anything that changes what a pass reads is not, and must be refused.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict, deque
from collections.abc import Callable

import attrs
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from piper_directives import build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_ir import (
    Instruction,
    NodeKind,
    Phase,
    PiperError,
    Program,
    Residency,
    SegmentRole,
    grad_name,
    is_grad,
)
from piper_memory import add_grad_norm, plan_memory
from piper_scheduler import compile_program, forward_only, verify
from piper_scheduler.matching import is_collective, p2p_sequences, recv_partners

EXAMPLES = int(os.environ.get("PIPER_HYPOTHESIS_EXAMPLES", "200"))


def _graph(schedule: str, mb: int, **kw: int):
    stages = kw.pop("stages", None)
    return plan_memory(build_schedule(schedule, 2, mb, stages=stages, **kw).apply(
        synthetic_graph(stages or 2, mb, 1, hidden=4, batch=2)))


BASES: dict[str, Program] = {
    "1f1b": compile_program(_graph("1f1b", 3)),
    "zb1p": compile_program(_graph("zb1p", 3)),
    "interleaved": compile_program(_graph("interleaved_1f1b", 2, stages=4)),
    "dualpipe": compile_program(_graph("dualpipe", 4)),
    "dp2-zero2-norm": compile_program(add_grad_norm(_graph("1f1b", 2, dp=2, zero=2), 1.0)),
    "zb1p-dp2-zero3": compile_program(_graph("zb1p", 2, dp=2, zero=3)),
    "dp2-zero3-eval": compile_program(forward_only(_graph("1f1b", 2, dp=2, zero=3))),
}

_TERMS: dict[tuple, int] = {}


def _term(*parts: object) -> int:
    """A symbolic value: equal parts, equal term (interned, so terms stay small)."""
    return _TERMS.setdefault(parts, len(_TERMS))


@attrs.define
class _Rank:
    replica: int
    acts: dict = attrs.Factory(dict)  # (value, mb) -> term
    grads: dict = attrs.Factory(lambda: defaultdict(list))  # (grad value, mb) -> contributions
    saved: dict = attrs.Factory(dict)  # (segment, mb) -> its forward
    halves: dict = attrs.Factory(dict)  # (segment, mb) -> its BI
    full: dict = attrs.Factory(lambda: defaultdict(list))  # segment -> parameter gradient contributions
    shard: dict = attrs.Factory(lambda: defaultdict(list))  # segment -> reduce-scattered shards
    steps: dict = attrs.Factory(dict)  # segment -> its step
    gathered: set = attrs.Factory(set)  # buckets materialized now
    norm: int | None = None
    seen: list = attrs.Factory(list)


def _pass(program: Program, rank: _Rank, ins: Instruction) -> None:
    seg = program.segment_by_id[ins.segment or ""]
    s, mb = seg.id, ins.microbatch or 0
    buckets = {b.id: b for b in program.buckets}
    held = tuple(sorted(b for b in rank.gathered if buckets[b].segment == s))
    if ins.kind is NodeKind.OPTIMIZER:
        step = _term("OPT", s, tuple(sorted(rank.full[s])), tuple(sorted(rank.shard[s])), rank.norm)
        rank.steps[s] = step
        rank.seen.append(step)
        return
    batch = set(program.inputs) | set(program.targets)
    if ins.phase is Phase.F:
        reads = tuple(_term("batch", x, mb, rank.replica) if x in batch else rank.acts.get((x, mb), -1)
                      for x in seg.inputs)
        f = rank.saved[(s, mb)] = _term("F", s, mb, reads, held)
        for y in seg.outputs:
            rank.acts[(y, mb)] = _term("out", f, y)
        if seg.role is SegmentRole.LOSS:
            rank.seen.append(f)
        return
    if ins.phase is Phase.BW:
        rank.full[s].append(_term("dw", _term("BW", rank.halves.get((s, mb), -1), held)))
        return
    upstream = tuple(tuple(sorted(rank.grads[(grad_name(y), mb)])) for y in seg.outputs)
    b = _term(ins.phase.value, s, mb, rank.saved.get((s, mb), -1), upstream, held)
    for x in dict.fromkeys(seg.inputs):
        rank.grads[(grad_name(x), mb)].append(_term("dx", b, x))
    if ins.phase is Phase.B:
        rank.full[s].append(_term("dw", b))
    else:
        rank.halves[(s, mb)] = b


def _collective(program: Program, ranks: list[_Rank], key: tuple[str, int], at: dict[int, Instruction]) -> None:
    """Every member of ``key``'s communicator is at its collective ``at[member]``."""
    buckets = {b.id: b for b in program.buckets}

    def state(r: int, ins: Instruction) -> object:
        if ins.kind is NodeKind.GRAD_NORM:
            return tuple((s, tuple(sorted(ranks[r].full[s])), tuple(sorted(ranks[r].shard[s]))) for s in sorted(ranks[r].full))
        if ins.value in buckets:
            s = buckets[ins.value].segment
            return tuple(sorted(ranks[r].full[s])), tuple(sorted(ranks[r].shard[s])), ranks[r].steps.get(s)
        return None

    term = _term("collective", *key, tuple((r, ins.kind.value, ins.value, state(r, ins)) for r, ins in sorted(at.items())))
    for r, ins in at.items():
        rank, bucket = ranks[r], buckets.get(ins.value or "")
        if ins.kind is NodeKind.COMPUTE:  # a tensor-parallel pass: its all-reduces inside
            _pass(program, rank, ins)
        elif ins.kind is NodeKind.GRAD_NORM:
            rank.norm = term
            rank.seen.append(term)
        elif bucket is None:
            continue
        elif ins.kind is NodeKind.ALL_REDUCE:
            (rank.shard if bucket.optimizer_home is Residency.SHARDED else rank.full)[bucket.segment][:] = [term]
        elif ins.kind is NodeKind.REDUCE_SCATTER:
            rank.shard[bucket.segment].append(term)
            rank.full[bucket.segment].clear()
        elif ins.kind is NodeKind.ALL_GATHER:
            rank.seen.append(term)
        elif ins.kind is NodeKind.MATERIALIZE:
            rank.gathered.add(bucket.id)


def execute(program: Program) -> object:
    """What the sequential runtime would observe running ``program`` (module doc)."""
    ranks = [_Rank(plan.replica) for plan in program.ranks]
    members = {c.id: len(c.ranks) for c in program.communicators}
    channels: dict[tuple, deque] = defaultdict(deque)
    issued: dict[tuple[int, str], int] = defaultdict(int)  # collectives a rank issued on a communicator
    arrived: dict[tuple[str, int], dict[int, Instruction]] = {}
    pc = [0] * len(ranks)
    moved = True
    while moved:
        moved = False
        for r, plan in enumerate(program.ranks):
            rank = ranks[r]
            while pc[r] < len(plan.instructions):
                ins = plan.instructions[pc[r]]
                mb, value = ins.microbatch or 0, ins.value or ""
                if ins.kind is NodeKind.RECV:
                    queue = channels[(ins.communicator, ins.peer, r)]
                    if not queue:
                        break
                    if is_grad(value):
                        rank.grads[(value, mb)].append(queue.popleft())
                    else:
                        rank.acts[(value, mb)] = queue.popleft()
                elif is_collective(ins):
                    comm = ins.communicator or ""
                    key = (comm, issued[(r, comm)])
                    here = arrived.setdefault(key, {})
                    here[r] = ins
                    if len(here) < members.get(comm, 0):
                        break
                    del arrived[key]
                    _collective(program, ranks, key, here)
                    for m in here:
                        pc[m] += 1
                        issued[(m, comm)] += 1
                    moved = True
                    continue
                elif ins.kind is NodeKind.SEND:  # a gradient's contributions so far, summed
                    message = (_term("sum", tuple(sorted(rank.grads[(value, mb)]))) if is_grad(value)
                               else rank.acts.get((value, mb), -1))
                    channels[(ins.communicator, r, ins.peer)].append(message)
                elif ins.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER):
                    _pass(program, rank, ins)
                elif ins.kind is NodeKind.FREE:
                    rank.gathered.discard(ins.value)
                pc[r] += 1
                moved = True
    if any(pc[r] < len(plan.instructions) for r, plan in enumerate(program.ranks)):
        return "deadlock"
    return tuple(tuple(sorted(rank.seen)) for rank in ranks)


EXPECTED = {name: execute(program) for name, program in BASES.items()}


# Mutations: each draws what it changes and returns the mutated program and a description
# (None: nothing of the kind to mutate).
Mutated = tuple[Program, str] | None

def _with(program: Program, rank: int, instructions: list[Instruction]) -> Program:
    ranks = list(program.ranks)
    ranks[rank] = attrs.evolve(ranks[rank], instructions=instructions)
    return attrs.evolve(program, ranks=ranks)


def _changed(program: Program, slots: list[tuple[int, int]], **changes: object) -> Program:
    for r, i in slots:
        plan = list(program.ranks[r].instructions)
        plan[i] = attrs.evolve(plan[i], **changes)
        program = _with(program, r, plan)
    return program


def _slot(data: st.DataObject, program: Program, keep: Callable[[Instruction], bool] = lambda ins: True) -> tuple[int, int] | None:
    slots = [(p.rank, i) for p in program.ranks for i, ins in enumerate(p.instructions) if keep(ins)]
    return data.draw(st.sampled_from(slots)) if slots else None


def drop(data: st.DataObject, program: Program) -> Mutated:
    r, i = _slot(data, program) or (0, 0)  # every base plan has instructions
    plan = list(program.ranks[r].instructions)
    gone = plan.pop(i)
    plan = [attrs.evolve(ins, waits=[e for e in ins.waits if e != gone.record]) for ins in plan]
    return _with(program, r, plan), f"drop {gone.id} on rank {r}"


def duplicate(data: st.DataObject, program: Program) -> Mutated:
    r, i = _slot(data, program) or (0, 0)  # every base plan has instructions
    plan = list(program.ranks[r].instructions)
    plan.insert(i + 1, attrs.evolve(plan[i], id=plan[i].id + ".again", record=None))
    return _with(program, r, plan), f"duplicate {plan[i].id} on rank {r}"


def swap(data: st.DataObject, program: Program) -> Mutated:
    r, i = _slot(data, program) or (0, 0)  # every base plan has instructions
    plan = list(program.ranks[r].instructions)
    j = data.draw(st.integers(0, len(plan) - 1) | st.integers(max(0, i - 2), min(len(plan) - 1, i + 2)))
    plan[i], plan[j] = plan[j], plan[i]
    return _with(program, r, plan), f"swap {plan[j].id} and {plan[i].id} on rank {r}"


def step_earlier(data: st.DataObject, program: Program) -> Mutated:
    slot = _slot(data, program, lambda ins: ins.kind is NodeKind.OPTIMIZER)
    if slot is None:
        return None
    r, i = slot
    plan = list(program.ranks[r].instructions)
    j = data.draw(st.integers(0, i))
    plan.insert(j, plan.pop(i))
    return _with(program, r, plan), f"move {plan[j].id} on rank {r} from {i} to {j}"


def _other_microbatch(data: st.DataObject, program: Program, ins: Instruction) -> int | None:
    others = [m for m in range(program.microbatches) if m != ins.microbatch]
    return data.draw(st.sampled_from(others)) if others else None


def relabel(data: st.DataObject, program: Program) -> Mutated:
    slot = _slot(data, program, lambda ins: ins.microbatch is not None and ins.kind in
                 (NodeKind.COMPUTE, NodeKind.SEND, NodeKind.RECV))
    if slot is None:
        return None
    ins = program.ranks[slot[0]].instructions[slot[1]]
    mb = _other_microbatch(data, program, ins)
    if mb is None:
        return None
    return _changed(program, [slot], microbatch=mb), f"relabel {ins.id} on rank {slot[0]} as microbatch {mb}"


def _message(data: st.DataObject, program: Program) -> list[tuple[int, int]] | None:
    """A RECV and the SEND it matches."""
    partners = recv_partners(*p2p_sequences(program))
    if not partners:
        return None
    recv = data.draw(st.sampled_from(sorted(partners)))
    return [partners[recv], recv]


def relabel_message(data: st.DataObject, program: Program) -> Mutated:
    slots = _message(data, program)
    if slots is None:
        return None
    ins = program.ranks[slots[0][0]].instructions[slots[0][1]]
    mb = _other_microbatch(data, program, ins)
    if mb is None:
        return None
    return _changed(program, slots, microbatch=mb), f"relabel message {ins.id} as microbatch {mb}"


def reshape(data: st.DataObject, program: Program) -> Mutated:
    both = data.draw(st.booleans())
    slots = _message(data, program) if both else [_slot(data, program, lambda ins: ins.kind in
                                                          (NodeKind.SEND, NodeKind.RECV))]
    if slots is None or slots[0] is None:
        return None
    meta = program.ranks[slots[0][0]].instructions[slots[0][1]].meta
    shape = (meta.shape[0] + 1, *meta.shape[1:]) if meta.shape else (2,)
    ids = [program.ranks[r].instructions[i].id for r, i in slots]
    return _changed(program, slots, meta=attrs.evolve(meta, shape=shape)), f"reshape {ids} to {list(shape)}"


MUTATIONS = [drop, duplicate, swap, step_earlier, relabel, relabel_message, reshape]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_mutated_plan_is_refused_or_computes_the_same(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(BASES)))
    mutate = data.draw(st.sampled_from(MUTATIONS))
    mutated = mutate(data, BASES[name])
    if mutated is None:
        return
    program, what = mutated
    try:
        verify(program)
    except PiperError as err:
        rule = re.search(r"\[([a-z ]+)\]$", str(err).splitlines()[0])
        event(f"refused: {mutate.__name__}: {rule.group(1) if rule else type(err).__name__}")
        return
    event(f"accepted: {mutate.__name__}")
    assert execute(program) == EXPECTED[name], f"{name}: {what} verifies but computes something else"


def test_the_oracle_sees_a_broken_plan_and_ignores_a_harmless_one() -> None:
    """``execute`` tells the two apart: a loss backward before its forward changes what it
    reads; the two optimizer steps at the end of a DualPipe rank are independent."""
    program = BASES["1f1b"]
    plan = list(program.ranks[1].instructions)
    f = next(i for i, ins in enumerate(plan) if ins.id == "F.loss.mb0")
    plan[f], plan[f + 1] = plan[f + 1], plan[f]
    assert execute(_with(program, 1, plan)) != EXPECTED["1f1b"]
    program = BASES["dualpipe"]
    plan = list(program.ranks[0].instructions)
    assert [ins.kind for ins in plan[-2:]] == [NodeKind.OPTIMIZER] * 2
    plan[-2], plan[-1] = plan[-1], plan[-2]
    swapped = _with(program, 0, plan)
    verify(swapped)
    assert execute(swapped) == EXPECTED["dualpipe"]
