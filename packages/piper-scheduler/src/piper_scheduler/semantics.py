"""What a program computes: every pass once where it must run, each after what it reads.

A ``Program`` carries no graph, but its tables say what the graph required
(docs/ir-conventions.md sections 1-7): every segment runs a forward ``F`` of every
microbatch; a training program (one with any backward or optimizer step) runs, on the rank
of each forward, its backward (``B``, or ``BI`` then ``BW``), and on each rank that computes
a segment's parameter gradients that segment's ``OPT`` (segments with parameters). A pass
reads the values its segment lists, of its own microbatch: produced by a pass on its rank or
received. ``verify`` runs these checks after matching, so sends and receives agree already.

Rules (each message names the rank, the instruction and the rule in brackets;
``SchedulingError``), checked rank by rank while indexing (``plan_index``), then for the
whole program, then rank by rank:

- ``[shape]``: a SEND/RECV moves its value's shape and dtype (``Program.values``), a bucket
  operation its bucket's dtype.
- ``[once]``: a (segment, phase, microbatch) runs at most once per rank, and a compute pass
  at most once per replica (data-parallel replica index, tensor-parallel position).
- ``[every microbatch]``: each placed segment's forward runs for every microbatch, on the
  same replicas as its other microbatches.
- ``[backward after forward]`` (training): each forward has exactly one backward on its
  rank, ``B`` or both ``BI`` and ``BW``, after it (``BW`` after ``BI``); no backward lacks one.
- ``[dataflow]``: a forward reads each input another segment produces (a batch input is
  read from the batch) after the forward producing it on its rank, or after receiving it,
  for its own microbatch; a backward reads the gradient of each output that needs one
  (``requires_grad``, read by a segment) after the backwards of its readers on its rank or
  after receiving it; a SEND sends after every pass producing what it sends on its rank.
  With the matching ``verify`` checked before (a message's microbatch, value and shape are
  its receive's), a chain of these orders every backward after its forward across ranks.
- ``[optimizer after backward]``, ``[gradients after reduce-scatter]`` and ``[gathered
  parameters]``: steps, reductions and ZeRO's gathers (``gradient_rules``).

"After" is happens-before (``HappensBefore``): one stream's order or a chain of events, the
order a sequential and a threaded runtime both keep. Every rule is a table lookup per
instruction and per value its segment reads or writes (a binary search among a bucket's
gathers): linear in the plan and the graph, up to a logarithm.
"""

from __future__ import annotations

from collections.abc import Iterable

from piper_ir import Phase, Program, ShardKind, is_grad
from piper_scheduler.diagnostics import describe
from piper_scheduler.gradient_rules import check_gradients
from piper_scheduler.kinds import PHASE_B, PHASE_BI, PHASE_BW, PHASE_F, PHASE_OPT
from piper_scheduler.plan_index import PassKey, RankIndex, Tables, fail, label

INPUT_GRADS = (Phase.B, Phase.BI)  # passes that yield the gradients of a segment's inputs
BACKWARDS = frozenset({Phase.B, Phase.BI, Phase.BW})


def check_semantics(program: Program) -> None:
    """Raise ``SchedulingError`` on the first broken rule (module doc). Requires a program
    whose references, events and matching ``verify`` checked."""
    tables = Tables(program)
    ranks = [RankIndex(program, tables, plan) for plan in program.ranks]
    _check_coverage(program, ranks)
    training = any(key[1] in BACKWARDS or key[1] is PHASE_OPT for rank in ranks for key in rank.passes)
    for rank in ranks:
        if training:
            _check_backwards(program, rank)
        _check_dataflow(tables, rank)
        check_gradients(program, tables, rank)


def _positions(program: Program) -> dict[str, dict[int, int]]:
    """Per tensor-parallel segment, each rank's position in its group (the first sharding of
    a segment counts, as in compile)."""
    out: dict[str, dict[int, int]] = {}
    for sh in program.sharding:
        if sh.kind is ShardKind.TP and sh.segment not in out:
            out[sh.segment] = {d: k % sh.degree for k, d in enumerate(sh.devices)}
    return out


def _check_coverage(program: Program, ranks: list[RankIndex]) -> None:
    positions = _positions(program)
    # (segment, phase, microbatch) -> (replica, position) -> (rank, index)
    runs: dict[PassKey, dict[tuple[int, int], tuple[int, int]]] = {}
    for rank in ranks:
        replica = rank.plan.replica
        for key, i in rank.passes.items():
            if key[1] is PHASE_OPT:
                continue  # a segment steps on every rank holding its parameters (mirrors too)
            where = (replica, positions[key[0]].get(rank.rank, 0) if key[0] in positions else 0)
            done = runs.get(key)  # not ``setdefault``: it makes a table per call (132k passes)
            if done is None:
                done = runs[key] = {}
            elif where in done:
                r, j = done[where]
                place = f"replica {where[0]}" + (f", tensor-parallel position {where[1]}" if key[0] in positions else "")
                fail(program, "once", f"{describe(program, rank.rank, i)} runs {label(key)}, which rank {r} "
                     f"runs already ({program.ranks[r].instructions[j].id}), both as {place}", [(r, j), (rank.rank, i)])
            done[where] = (rank.rank, i)
    placement = dict(program.placement)
    for seg in program.segments:
        per_mb = [runs.get((seg.id, PHASE_F, m), {}) for m in range(program.microbatches)]
        expected = set().union(*per_mb)
        if not expected:
            if placement.get(seg.id):
                fail(program, "every microbatch", f"segment {seg.id} is placed on ranks {list(placement[seg.id])} "
                     "but runs no forward", [], list(placement[seg.id]))
            continue
        for m, got in enumerate(per_mb):
            if len(got) == len(expected):
                continue
            elsewhere = sorted({r for runs_m in per_mb for r, _ in runs_m.values()})
            if not got:
                fail(program, "every microbatch", f"segment {seg.id} runs no forward of microbatch {m} on any rank "
                     f"(the program has {program.microbatches}; ranks {elsewhere} run the others)", [], elsewhere)
            replica, position = min(expected - got.keys())
            where = f"replica {replica}" + (f", tensor-parallel position {position}" if seg.id in positions else "")
            fail(program, "every microbatch", f"segment {seg.id} runs its forward of microbatch {m} on ranks "
                 f"{sorted(r for r, _ in got.values())} but not as {where}, as it runs its other microbatches "
                 f"(on ranks {elsewhere})", [], elsewhere)


def _check_backwards(program: Program, rank: RankIndex) -> None:
    passes, r, precedes = rank.passes, rank.rank, rank.order.precedes
    rule = "backward after forward"
    for key, i in passes.items():
        seg, phase, mb = key
        if phase is not PHASE_F:
            if phase in BACKWARDS and (seg, PHASE_F, mb) not in passes:
                fail(program, rule, f"{describe(program, r, i)} runs a backward of {seg} microbatch {mb}, "
                     f"whose forward rank {r} never runs", [(r, i)])
            continue
        b, bi, bw = passes.get((seg, PHASE_B, mb)), passes.get((seg, PHASE_BI, mb)), passes.get((seg, PHASE_BW, mb))
        if b is not None:
            if bi is not None or bw is not None:
                j = bi if bi is not None else bw
                fail(program, rule, f"{describe(program, r, j)} splits the backward of {seg} microbatch {mb}, "
                     f"which instruction {b} runs whole already", [(r, b), (r, j)])
            if not precedes(i, b):
                rank.fail_order(rule, i, b, f"its forward {label(key)}")
        elif bi is not None and bw is not None:
            if not precedes(i, bi):
                rank.fail_order(rule, i, bi, f"its forward {label(key)}")
            if not precedes(bi, bw):
                rank.fail_order(rule, bi, bw, f"the input half {seg}:BI{mb} it continues")
        elif bi is None and bw is None:
            fail(program, rule, f"{describe(program, r, i)} has no backward on rank {r} "
                 f"(neither {seg}:B{mb} nor {seg}:BI{mb} and {seg}:BW{mb})", [(r, i)])
        else:
            j = bi if bi is not None else bw
            fail(program, rule, f"{describe(program, r, j)} is half a split backward: rank {r} never runs "
                 f"{seg}:{'BW' if bw is None else 'BI'}{mb}", [(r, j)])


def _check_dataflow(tables: Tables, rank: RankIndex) -> None:
    # ``need`` judges, and describes, every read but the common one: a single source (a
    # local producer, or one receive) that precedes its reader, tested inline (392k reads
    # at 16,384 devices).
    passes, recvs, need, precedes = rank.passes, rank.recvs, rank.need, rank.order.precedes
    reads, grads = tables.reads, tables.grads
    for (seg, phase, mb), i in passes.items():
        if phase is PHASE_F:
            for x, producer in reads[seg]:
                got = recvs.get((x, mb))
                j = passes.get((producer, PHASE_F, mb))
                if j is None:
                    if got is None or len(got) != 1 or not precedes(got[0], i):
                        need(i, x, mb, got or [])
                elif got is not None or not precedes(j, i):
                    need(i, x, mb, [j, *(got or ())])
        elif phase is PHASE_B or phase is PHASE_BI:
            for g, readers in grads[seg]:
                sources = _yielding(passes, readers, mb)
                got = recvs.get((g, mb))
                if sources or got is None or len(got) != 1 or not precedes(got[0], i):
                    need(i, g, mb, sources + (got or []))
    instructions, grad_readers = rank.plan.instructions, tables.grad_readers
    for i in rank.sends:
        ins = instructions[i]
        v, mb = ins.value or "", ins.microbatch or 0
        if is_grad(v):
            sources = _yielding(passes, grad_readers.get(v, ()), mb)
            if len(sources) == 1 and (v, mb) not in recvs and precedes(sources[0], i):
                continue
        elif v in tables.batch or v not in tables.producer:
            continue
        else:
            j = passes.get((tables.producer[v], PHASE_F, mb))
            if j is not None and (v, mb) not in recvs and precedes(j, i):
                continue
            sources = [] if j is None else [j]
        need(i, v, mb, sources + recvs.get((v, mb), []))


def _yielding(passes: dict[PassKey, int], readers: Iterable[str], mb: int) -> list[int]:
    """The backwards on a rank that yield gradients of a value for ``mb``: its readers'."""
    out = []
    for seg in readers:
        j = passes.get((seg, PHASE_B, mb))
        if j is None:
            j = passes.get((seg, PHASE_BI, mb))
        if j is not None:
            out.append(j)
    return out


