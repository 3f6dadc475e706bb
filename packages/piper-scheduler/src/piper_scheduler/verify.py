"""Prove a ``Program`` runs to completion, and computes what its graph asks, before any
process starts it.

Checks, in this order (the first failure raises):

1. tables and counts (``piper_scheduler.references.check_tables``): positive world size,
   microbatches and replicas; unique ids; communicators, placement, replication, buckets and
   sharding name existing segments, parameters and ranks (``SchedulingError``);
2. structure: one plan per rank, unique instruction ids per rank, every SEND/RECV names a
   peer and a communicator both ranks belong to, every collective names a communicator that
   holds its rank; then every segment, value, bucket and microbatch an instruction names
   exists or lies in range (``check_instructions``) (``SchedulingError``);
3. events: every event waited on is recorded exactly once on the same rank, earlier in the
   sequential order (``SchedulingError``);
4. point-to-point: per (communicator, src, dst) the (value, microbatch, meta) sequence that
   src sends equals the one dst receives (``DeadlockError``);
5. collectives: every member of a communicator issues the same collectives in the same order
   (``DeadlockError``); a tensor-parallel segment's compute counts as a collective on its
   group's communicator;
6. what the plan computes (``piper_scheduler.semantics``): every pass once per replica and
   every microbatch, each backward after its forward, every pass after what it reads, every
   step after the gradients it steps, shapes as the values say (``SchedulingError`` naming
   the rule);
7. progress: walking every rank's list with buffered SENDs, blocking RECVs and blocking
   collectives finishes (``DeadlockError`` naming each stuck rank's blocked instruction).

Every message names ranks, streams and instructions and shows the plans around the culprit.
"""

from __future__ import annotations

from collections import deque

from piper_ir import DeadlockError, Instruction, Program, RankPlan, SchedulingError, gc_paused
from piper_scheduler.diagnostics import describe, excerpts
from piper_scheduler.kinds import RECV, SEND
from piper_scheduler.matching import (
    Channel,
    Slot,
    collective_sequences,
    collective_slots,
    is_collective,
    p2p_sequences,
    recv_partners,
)
from piper_scheduler.references import check_instructions, check_tables
from piper_scheduler.semantics import check_semantics


def verify(program: Program) -> None:
    """Raise ``SchedulingError`` / ``DeadlockError`` unless ``program`` is sound (module doc); else None.
    Runs with the cyclic collector paused (``gc_paused``), as ``compile_program`` does: its
    tables grow with the program, and the collections they trigger walk all of it."""
    with gc_paused():
        _verify(program)


def _verify(program: Program) -> None:
    check_tables(program)
    _check_structure(program)
    check_instructions(program)
    _check_events(program)
    sends, recvs = p2p_sequences(program)
    _check_p2p(program, sends, recvs)
    collectives = collective_sequences(program)  # a pass over the plan: made once, read twice
    _check_collectives(program, collectives)
    check_semantics(program)
    _check_progress(program, recv_partners(sends, recvs), collective_slots(program, collectives))


def _fail(cls: type[SchedulingError], program: Program, message: str, slots: list[Slot]) -> None:
    nodes = [program.ranks[r].instructions[i].id for r, i in slots if i < len(program.ranks[r].instructions)]
    ranks = sorted({r for r, _ in slots})
    raise cls(message + "\n" + excerpts(program, slots), nodes=nodes, ranks=ranks)


def _check_structure(program: Program) -> None:
    if len(program.ranks) != program.world_size:
        raise SchedulingError(
            f"program has {len(program.ranks)} rank plans for world size {program.world_size}"
        )
    # communicator id -> its ranks, as a set: a pipeline's communicator spans every stage
    comms = {c.id: frozenset(c.ranks) for c in program.communicators}
    world = program.world_size
    for r, plan in enumerate(program.ranks):
        if plan.rank != r:
            raise SchedulingError(f"plan {r} says it is for rank {plan.rank}", ranks=[r])
        # ids told unique by one set made in C; only a plan with an id twice keeps a table
        # of them, to name the first one seen again where the walk meets it
        seen: dict[str, int] | None = None
        if len({ins.id for ins in plan.instructions}) != len(plan.instructions):
            seen = {}
        for i, ins in enumerate(plan.instructions):
            if seen is not None:
                if ins.id in seen:
                    _fail(
                        SchedulingError,
                        program,
                        f"instruction id {ins.id!r} appears twice on rank {r}",
                        [(r, seen[ins.id]), (r, i)],
                    )
                seen[ins.id] = i
            kind = ins.kind
            if kind is SEND or kind is RECV:
                # ``_check_p2p_fields``'s tests, inline for the transfers that pass them (two
                # thirds of the instructions); it judges, and describes, the rest.
                peer, members = ins.peer, comms.get(ins.communicator or "")
                if (peer is None or not 0 <= peer < world or peer == r or members is None
                        or r not in members or peer not in members):
                    _check_p2p_fields(program, comms, r, i, ins)
            elif is_collective(ins):
                members = comms.get(ins.communicator or "")
                if members is None or r not in members:
                    _fail(
                        SchedulingError,
                        program,
                        f"{describe(program, r, i)} uses communicator {ins.communicator!r}, which does not hold rank {r}",
                        [(r, i)],
                    )


def _check_p2p_fields(program: Program, comms: dict[str, frozenset[int]], r: int, i: int, ins: Instruction) -> None:
    # Called for every SEND and RECV: the instruction is described only when it fails.
    if ins.peer is None or not 0 <= ins.peer < program.world_size or ins.peer == r:
        _fail(SchedulingError, program, f"{describe(program, r, i)} has invalid peer {ins.peer!r}", [(r, i)])
    members = comms.get(ins.communicator or "")
    if members is None:
        _fail(
            SchedulingError,
            program,
            f"{describe(program, r, i)} uses unknown communicator {ins.communicator!r}",
            [(r, i)],
        )
    elif r not in members or ins.peer not in members:
        _fail(
            SchedulingError,
            program,
            f"{describe(program, r, i)}: communicator {ins.communicator!r} does not hold ranks {r} and {ins.peer}",
            [(r, i)],
        )


def _check_events(program: Program) -> None:
    """One pass per rank proves its events sound: each waited event recorded earlier on the
    rank, none recorded twice. A rank that fails it is judged, and described, by
    ``_explain_events``."""
    for plan in program.ranks:
        seen: set[str] = set()
        for ins in plan.instructions:
            for ev in ins.waits:
                if ev not in seen:
                    _explain_events(program, plan)
            record = ins.record
            if record is not None:
                if record in seen:
                    _explain_events(program, plan)
                seen.add(record)


def _explain_events(program: Program, plan: RankPlan) -> None:
    """Raise the first broken event rule of ``plan``: an event recorded twice, then, in list
    order, a wait on an event never recorded or recorded later."""
    r = plan.rank
    recorded_at: dict[str, int] = {}
    for i, ins in enumerate(plan.instructions):
        if ins.record is not None:
            if ins.record in recorded_at:
                _fail(
                    SchedulingError,
                    program,
                    f"event {ins.record!r} is recorded twice on rank {r}",
                    [(r, recorded_at[ins.record]), (r, i)],
                )
            recorded_at[ins.record] = i
    seen: set[str] = set()
    for i, ins in enumerate(plan.instructions):
        for ev in ins.waits:
            if ev not in recorded_at:
                _fail(
                    SchedulingError,
                    program,
                    f"{describe(program, r, i)} waits on event {ev!r}, which is never recorded on rank {r}",
                    [(r, i)],
                )
            if ev not in seen:
                j = recorded_at[ev]
                _fail(
                    SchedulingError,
                    program,
                    f"{describe(program, r, i)} waits on event {ev!r}, which is recorded later, by instruction {j}",
                    [(r, i), (r, j)],
                )
        if ins.record is not None:
            seen.add(ins.record)


def _message(ins: Instruction) -> str:
    meta = f" {list(ins.meta.shape)}/{ins.meta.dtype}" if ins.meta else ""
    return f"{ins.value} mb={ins.microbatch}{meta}"


def _check_p2p(program: Program, sends: dict[Channel, list[int]], recvs: dict[Channel, list[int]]) -> None:
    for key in sorted(set(sends) | set(recvs)):
        comm, src, dst = key
        s_idx, r_idx = sends.get(key, []), recvs.get(key, [])
        s_plan, r_plan = program.ranks[src].instructions, program.ranks[dst].instructions
        where = f"communicator {comm!r}, rank {src} -> rank {dst}"
        for k, (si, ri) in enumerate(zip(s_idx, r_idx, strict=False)):
            a, b = s_plan[si], r_plan[ri]
            if (a.value, a.microbatch, a.meta) != (b.value, b.microbatch, b.meta):
                _fail(
                    DeadlockError,
                    program,
                    f"{where}: message {k} differs: rank {src} sends {_message(a)} ({a.id}) "
                    f"but rank {dst} receives {_message(b)} ({b.id})",
                    [(src, si), (dst, ri)],
                )
        n = min(len(s_idx), len(r_idx))
        if len(s_idx) > n:
            si = s_idx[n]
            _fail(
                DeadlockError,
                program,
                f"{where}: send with no matching receive: {describe(program, src, si)} is message {n} but rank {dst} receives only {n}",
                [(src, si)],
            )
        if len(r_idx) > n:
            ri = r_idx[n]
            _fail(
                DeadlockError,
                program,
                f"{where}: receive with no matching send: {describe(program, dst, ri)} is message {n} but rank {src} sends only {n}",
                [(dst, ri)],
            )


def _check_collectives(program: Program, sequences: dict[str, dict[int, list[int]]]) -> None:
    """``sequences``: ``collective_sequences(program)``."""
    comms = {c.id: c for c in program.communicators}
    for comm_id, by_rank in sorted(sequences.items()):
        members = sorted(comms[comm_id].ranks)
        ref = members[0]
        ref_ids = [program.ranks[ref].instructions[i].id for i in by_rank.get(ref, [])]
        for m in members[1:]:
            idx = by_rank.get(m, [])
            ids = [program.ranks[m].instructions[i].id for i in idx]
            if ids == ref_ids:
                continue
            k = next(
                (k for k, (a, b) in enumerate(zip(ref_ids, ids, strict=False)) if a != b),
                min(len(ids), len(ref_ids)),
            )
            slots = [
                (rank, seq[k] if k < len(seq) else len(program.ranks[rank].instructions))
                for rank, seq in ((ref, by_rank.get(ref, [])), (m, idx))
            ]
            have = [names[k] if k < len(names) else "nothing" for names in (ref_ids, ids)]
            _fail(
                DeadlockError,
                program,
                f"communicator {comm_id!r}: collective {k} differs between members: "
                f"rank {ref} issues {have[0]} but rank {m} issues {have[1]}",
                slots,
            )


def _check_progress(program: Program, partners: dict[Slot, Slot], coll: dict[Slot, tuple[str, int]]) -> None:
    """``partners``: ``recv_partners``; ``coll``: ``collective_slots``."""
    plans = [p.instructions for p in program.ranks]
    members = {c.id: len(c.ranks) for c in program.communicators}
    pc = [0] * len(plans)
    arrived: dict[tuple[str, int], int] = {}
    at_collective: set[int] = set()  # ranks that counted themselves at their current collective
    waiting: dict[object, list[int]] = {}
    work = deque(range(len(plans)))
    while work:
        r = work.popleft()
        plan, i = plans[r], pc[r]
        end = len(plan)
        while i < end:
            ins = plan[i]
            kind = ins.kind
            if kind is SEND:
                # Only a SEND has receives waiting on it (``partners``' slots are sends; a
                # collective's waiters are keyed by communicator). ``pc[r]`` is stored before
                # they run: no other rank runs until this one blocks or ends.
                i += 1
                if waiting:
                    work.extend(waiting.pop((r, i - 1), ()))
                continue
            if kind is RECV:
                src, j = partners[(r, i)]
                if pc[src] <= j:
                    waiting.setdefault((src, j), []).append(r)
                    break
            elif coll and is_collective(ins):  # ``coll`` holds every collective: none, no test
                key = coll[(r, i)]
                if r not in at_collective:
                    at_collective.add(r)
                    arrived[key] = arrived.get(key, 0) + 1
                if arrived[key] < members[key[0]]:
                    waiting.setdefault(key, []).append(r)
                    break
                at_collective.discard(r)
                work.extend(waiting.pop(key, ()))
            i += 1
        pc[r] = i
    stuck = [r for r in range(len(plans)) if pc[r] < len(plans[r])]
    if not stuck:
        return
    lines = []
    for r in stuck:
        ins = plans[r][pc[r]]
        if ins.kind is RECV:
            src, j = partners[(r, pc[r])]
            why = (
                f"waits for {plans[src][j].id} (instruction {j} of rank {src}, which is blocked at {pc[src]})"
            )
        else:
            comm, k = coll[(r, pc[r])]
            why = f"waits for every member of {comm!r} to reach its collective {k}"
        lines.append(f"{describe(program, r, pc[r])} {why}")
    _fail(
        DeadlockError,
        program,
        "deadlock: ranks block forever:\n  " + "\n  ".join(lines),
        [(r, pc[r]) for r in stuck],
    )
