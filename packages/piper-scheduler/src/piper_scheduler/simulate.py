"""Run a ``Program`` against a cost model instead of hardware.

Each rank's streams run concurrently; a stream executes its instructions in list order. An
instruction starts when its stream is free and the events it waits on are recorded; a RECV
also needs its matching SEND to have started and finishes at
``max(send start + transfer cost, its own start)``; a SEND occupies its stream for the
transfer cost; a collective starts when every member has reached it and lasts one transfer.
``overhead`` / ``comm_overhead`` are added per instruction.

Compute of an overlapped slot (``Instruction.overlap``: DualPipe's F&B pair) is charged
``CostModel.overlap_factor()`` of its cost on its stream, so a pair whose halves cost F and
B occupies the stream for F&B. Its halves run interleaved, so neither publishes earlier
than it would alone: an instruction of the pair's forward (or backward) half completes, for
the events others wait on, no earlier than the pair's start plus that half's own cost up to
and including it; and the stream takes nothing else until every instruction of the pair has
completed (docs/schedules.md derives what this does to DualPipe's bubble).

A segment that recomputes its activations (``Segment.recompute``) runs its forward again at
the start of its backward: its ``B`` (or ``BI``, the half that comes first) is charged its
``F`` on top. A compute instruction is also charged the time its segment's own collectives
take (``CostModel.collectives``: tensor, sequence and context parallelism's, priced by
``costs.sharded_collectives``), which run inside it on its stream.

Start times follow from dependencies alone, so the order in which streams are visited does
not change the result (a dataflow fixpoint, computed with a worklist).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from piper_ir import DeadlockError, Instruction, NodeKind, Phase, Program, SchedulingError, SegmentRole
from piper_scheduler.costs import CostModel
from piper_scheduler.diagnostics import describe, excerpts
from piper_scheduler.matching import COLLECTIVE_KINDS, Slot, collective_slots, p2p_sequences, recv_partners
from piper_scheduler.timeline import Interval, Timeline

COMPUTE_KINDS = frozenset({NodeKind.COMPUTE, NodeKind.OPTIMIZER})


def simulate(program: Program, costs: CostModel | None = None) -> Timeline:
    """The timeline of ``program`` under ``costs`` (default ``CostModel()``)."""
    costs = costs or CostModel()
    plans = [p.instructions for p in program.ranks]
    partners = recv_partners(*p2p_sequences(program))
    coll = collective_slots(program)
    members = {c.id: len(c.ranks) for c in program.communicators}
    overlap = costs.overlap_factor()
    recomputed = {seg.id for seg in program.segments if seg.recompute}

    def compute_cost(ins: Instruction) -> float:
        cost = costs.compute_cost(ins.segment, ins.phase) + costs.collective_cost(ins.segment, ins.phase)
        if ins.segment in recomputed and ins.phase in (Phase.B, Phase.BI):
            cost += costs.compute_cost(ins.segment, Phase.F)  # the forward again, first
        return cost

    atomic = costs.pairs == "atomic"
    queues: dict[tuple[int, str], list[int]] = {}
    # Per (rank, overlap number): what the pair waits for as a whole and what it costs.
    pair_waits: dict[tuple[int, int], list[str]] = {}
    pair_cost: dict[tuple[int, int], float] = {}
    for r, plan in enumerate(plans):
        for i, ins in enumerate(plan):
            queues.setdefault((r, ins.stream), []).append(i)
            if ins.overlap is not None and ins.kind in COMPUTE_KINDS:
                key = (r, ins.overlap)
                pair_waits.setdefault(key, []).extend(ins.waits)
                charged = compute_cost(ins) * overlap + costs.overhead
                pair_cost[key] = pair_cost.get(key, 0.0) + charged
    head = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, float(costs.startup))
    start: dict[Slot, float] = {}
    end: dict[Slot, float] = {}
    events: dict[tuple[int, str], float] = {}
    pairs: dict[tuple[int, int], _Pair] = {}  # (rank, overlap number) -> the pair so far
    holding: dict[tuple[int, str], _Pair] = {}  # stream -> the pair it runs
    coll_ready: dict[tuple[str, int], dict[int, float]] = {}
    coll_time: dict[tuple[str, int], tuple[float, float]] = {}
    waiting: dict[object, list[tuple[int, str]]] = {}
    work = deque(queues)

    def wake(key: object) -> None:
        work.extend(waiting.pop(key, ()))

    while work:
        q_key = work.popleft()
        r, _ = q_key
        queue = queues[q_key]
        while head[q_key] < len(queue):
            i = queue[head[q_key]]
            ins = plans[r][i]
            t = free[q_key]
            pair = holding.get(q_key)
            if pair is not None and ins.overlap != pair.number:
                t = max(t, pair.done)  # the stream is the pair's until both halves are done
            blocked: object = None
            paired = ins.overlap is not None and ins.kind in COMPUTE_KINDS
            for ev in pair_waits[(r, ins.overlap)] if paired and atomic else ins.waits:
                if (r, ev) not in events:
                    blocked = (r, ev)
                    break
                t = max(t, events[(r, ev)])
            if blocked is None and ins.kind is NodeKind.RECV:
                send = partners.get((r, i))
                if send is None:
                    raise SchedulingError(
                        f"{describe(program, r, i)} has no matching send; run verify", ranks=[r]
                    )
                if send not in start:
                    blocked = send
                else:
                    st = max(t, start[send])
                    en = max(start[send] + costs.comm_cost(ins.meta), st) + costs.comm_overhead
            elif blocked is None and ins.kind in COLLECTIVE_KINDS:
                key = coll[(r, i)]
                if key not in coll_time:
                    ready = coll_ready.setdefault(key, {})
                    ready[r] = t
                    if len(ready) < members.get(key[0], 0):
                        blocked = key
                    else:
                        t0 = max(ready.values())
                        coll_time[key] = (t0, t0 + costs.comm_cost(ins.meta) + costs.comm_overhead)
                        wake(key)
                if blocked is None:
                    st, en = coll_time[key]
            elif blocked is None:
                st = t
                if ins.kind is NodeKind.SEND:
                    en = t + costs.comm_cost(ins.meta) + costs.comm_overhead
                elif ins.kind in COMPUTE_KINDS:
                    cost = compute_cost(ins)
                    if ins.overlap is not None:
                        en = t + cost * overlap + costs.overhead
                    else:
                        en = t + cost + costs.overhead
                else:
                    en = t
            if blocked is not None:
                waiting.setdefault(blocked, []).append(q_key)
                break
            done = en  # when what the instruction produces is there for others
            if paired:
                pair = pairs.setdefault((r, ins.overlap), _Pair(ins.overlap, st))
                if atomic:
                    done = pair.start + pair_cost[(r, ins.overlap)]
                    pair.done = done
                else:
                    alone = compute_cost(ins) + costs.overhead
                    done = pair.add(ins.phase is Phase.F, en, alone)
                holding[q_key] = pair
            else:
                holding.pop(q_key, None)
            start[(r, i)], end[(r, i)] = st, en
            free[q_key] = en
            head[q_key] += 1
            wake((r, i))
            if ins.record is not None:
                events[(r, ins.record)] = done
                wake((r, ins.record))

    stuck = [
        (r, queues[(r, s)][head[(r, s)]]) for (r, s) in sorted(queues) if head[(r, s)] < len(queues[(r, s)])
    ]
    if stuck:
        lines = "\n  ".join(describe(program, r, i) for r, i in stuck)
        raise DeadlockError(
            "simulation cannot finish; blocked instructions:\n  " + lines + "\n" + excerpts(program, stuck),
            ranks=sorted({r for r, _ in stuck}),
        )
    return _timeline(program, start, end)


class _Pair:
    """One overlapped F&B slot of one rank while it runs: when it started, how far each half
    would have got alone since then, and when its last instruction completed."""

    def __init__(self, number: int, start: float) -> None:
        self.number = number
        self.start = start
        self.alone = {True: start, False: start}  # forward half?, backward half
        self.done = start

    def add(self, forward: bool, end: float, cost: float) -> float:
        """Account an instruction of the pair that ran until ``end`` (charged the overlap
        factor) and costs ``cost`` alone; returns when its result is published."""
        self.alone[forward] += cost
        ready = max(end, self.alone[forward])
        self.done = max(self.done, ready)
        return ready


def measured_timeline(program: Program, spans: Iterable[tuple[int, str, float, float]]) -> Timeline:
    """The ``Timeline`` of a real run of ``program``: ``spans`` are ``(rank, instruction id,
    start, end)`` as a runtime measured them (``piper_runtime.InstructionTiming``, each
    rank's clock starting at its step); instructions without a span are left out. It plots
    with ``plot_gantt`` like a simulated one."""
    index = {(plan.rank, ins.id): (plan.rank, i) for plan in program.ranks for i, ins in enumerate(plan.instructions)}
    start: dict[Slot, float] = {}
    end: dict[Slot, float] = {}
    for rank, ident, s, e in spans:
        slot = index.get((rank, ident))
        if slot is None:
            raise ValueError(f"rank {rank} has no instruction {ident!r}")
        start[slot], end[slot] = s, e
    return _timeline(program, start, end)


def _timeline(program: Program, start: dict[Slot, float], end: dict[Slot, float]) -> Timeline:
    intervals: list[Interval] = []
    busy = [0.0] * program.world_size
    for plan in program.ranks:
        for i, ins in enumerate(plan.instructions):
            if (plan.rank, i) not in start:
                continue
            s, e = start[(plan.rank, i)], end[(plan.rank, i)]
            intervals.append(
                Interval(
                    plan.rank,
                    ins.stream,
                    ins.id,
                    ins.short(),
                    s,
                    e,
                    ins.kind,
                    ins.segment,
                    ins.phase,
                    ins.microbatch,
                    ins.overlap,
                )
            )
            if ins.kind in COMPUTE_KINDS:
                busy[plan.rank] += e - s
    makespan = max((iv.end for iv in intervals), default=0.0)
    return Timeline(
        makespan=makespan,
        busy=busy,
        idle=[makespan - b for b in busy],
        peak_memory=_peak_memory(program, intervals),
        intervals=intervals,
    )


def _peak_memory(program: Program, intervals: list[Interval]) -> list[int]:
    """Per rank, the most stage activations alive at once.

    +1 when a stage segment's F finishes, -1 when its B (or BW, the last half of a split
    backward) finishes; frees are counted before allocations at equal times. The loss
    segment counts 0.
    """
    stages = {s.id for s in program.segments if s.role is SegmentRole.STAGE}
    deltas: list[list[tuple[float, int]]] = [[] for _ in range(program.world_size)]
    for iv in intervals:
        if iv.kind is not NodeKind.COMPUTE or iv.segment not in stages:
            continue
        if iv.phase is Phase.F:
            deltas[iv.rank].append((iv.end, 1))
        elif iv.phase in (Phase.B, Phase.BW):
            deltas[iv.rank].append((iv.end, -1))
    peaks = []
    for rank_deltas in deltas:
        level = peak = 0
        for _, d in sorted(rank_deltas):
            level += d
            peak = max(peak, level)
        peaks.append(peak)
    return peaks
