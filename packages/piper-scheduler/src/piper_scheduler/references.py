"""Every reference and count of a ``Program`` checked: ``verify`` runs ``check_tables`` first
and ``check_instructions`` right after its per-rank structure check, before events and
matching.

A program read from a file may have been edited by hand or written by another tool, and a
runtime trusts it: an instruction naming a segment that does not exist fails on a worker,
mid-step, far from the cause. So every name must resolve and every count must be in range:

- counts: ``world_size``, ``microbatches`` and ``replicas`` positive, each rank's replica
  index below ``replicas``;
- tables: ids unique (segments, values, communicators, buckets); communicators hold
  distinct ranks in range; placement, replication, buckets (with their mirrors) and
  sharding name existing segments, parameters of those segments and ranks in range, with
  positive sizes; ties name two or more existing segments and parameters they hold and,
  when their holders span several ranks, sit in buckets of their own there (which the
  plan sums); a precision names floating dtypes; segments read and write existing values, as do the program's inputs and
  targets;
- instructions: compute and optimizer steps name an existing segment, a phase of their kind
  and, where placed, a rank of the segment's placement; transfers an existing value; bucket
  operations an existing bucket of their segment, with a ``meta`` of the bucket's size;
  microbatches in ``[0, microbatches)``; metas without negative dimensions; overlap numbers
  non-negative.

Each failure is a ``SchedulingError`` naming the rank and instruction, with the plan around
it and ``<-- here``; a bad table entry is named by its table.
"""

from __future__ import annotations

from collections.abc import Iterable

from piper_ir import (
    BUCKET_KINDS,
    COMPUTE_KINDS,
    POINT_TO_POINT_KINDS,
    Bucket,
    Instruction,
    NodeKind,
    Phase,
    Program,
    SchedulingError,
    ShardKind,
    Tie,
)
from piper_scheduler.diagnostics import describe, excerpts
from piper_scheduler.kinds import COMPUTE, OPTIMIZER, RECV, SEND

COMPUTE_PHASES = frozenset({Phase.F, Phase.B, Phase.BI, Phase.BW})
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})


def check_tables(program: Program) -> None:
    """Raise ``SchedulingError`` on the first bad count or dangling reference of the
    program's tables (module doc), before any instruction is looked at."""
    _check_counts(program)
    _check_tables(program)


def check_instructions(program: Program) -> None:
    """Raise ``SchedulingError`` on the first instruction that names something the program
    does not have or a microbatch out of range (module doc); ``program``'s tables are sound
    and its plans numbered by rank."""
    buckets = {b.id: b for b in program.buckets}
    placement = dict(program.placement)
    segments, values, microbatches = program.segment_by_id, program.value_by_name, program.microbatches
    sound_metas: set[int] = set()  # ids of the metas ``_problem`` passed: instructions share them
    for plan in program.ranks:
        rank = plan.rank
        for i, ins in enumerate(plan.instructions):
            # A transfer or a compute pass that passes every test ``_problem`` makes of its
            # kind, tested inline (392k instructions at 16,384 devices, two thirds transfers);
            # any other instruction, or any test that fails, is ``_problem``'s to judge.
            kind, mb, meta = ins.kind, ins.microbatch, ins.meta
            if (ins.stream and ins.overlap is None and (mb is None or 0 <= mb < microbatches)
                    and (meta is None or id(meta) in sound_metas)):
                if kind is SEND or kind is RECV:
                    if meta is not None and ins.segment is None and ins.value in values:
                        continue
                elif kind is COMPUTE and ins.phase in COMPUTE_PHASES and ins.segment in segments:
                    devices = placement.get(ins.segment)
                    if devices is None or rank in devices:
                        continue
            problem = _problem(program, buckets, placement, rank, ins)
            if problem is not None:
                where = describe(program, plan.rank, i)
                raise SchedulingError(
                    f"{where} {problem}\n" + excerpts(program, [(plan.rank, i)]), nodes=[ins.id], ranks=[plan.rank]
                )
            if meta is not None:
                sound_metas.add(id(meta))


def _check_counts(program: Program) -> None:
    for name in ("world_size", "microbatches", "replicas"):
        count = getattr(program, name)
        if count < 1:
            raise SchedulingError(f"the program's {name} is {count}; it must be positive")
    for plan in program.ranks:
        if not 0 <= plan.replica < program.replicas:
            raise SchedulingError(
                f"rank {plan.rank} is replica {plan.replica}, outside [0, {program.replicas})", ranks=[plan.rank]
            )


def _unique(what: str, ids: Iterable[str]) -> None:
    seen: set[str] = set()
    for x in ids:
        if x in seen:
            raise SchedulingError(f"the program has two {what} {x!r}")
        seen.add(x)


def _ranks(program: Program, what: str, ranks: tuple[int, ...], *, empty_ok: bool = False) -> None:
    """``ranks`` are distinct ranks of the program (``what`` names their owner)."""
    if not ranks and not empty_ok:
        raise SchedulingError(f"{what} holds no ranks")
    for r in ranks:
        if not 0 <= r < program.world_size:
            raise SchedulingError(f"{what} names rank {r}, outside world size {program.world_size}")
    if len(set(ranks)) != len(ranks):
        raise SchedulingError(f"{what} names a rank twice: {list(ranks)}")


def _check_tables(program: Program) -> None:
    _unique("segments", (s.id for s in program.segments))
    _unique("values", (v.name for v in program.values))
    _unique("communicators", (c.id for c in program.communicators))
    _unique("buckets", (b.id for b in program.buckets))
    _unique("placements of segment", (s for s, _ in program.placement))
    segments, values = program.segment_by_id, program.value_by_name
    buckets = {b.id for b in program.buckets}

    def segment(what: str, sid: str) -> None:
        if sid not in segments:
            raise SchedulingError(f"{what} names segment {sid!r}, which the program does not have")

    for what, names in (("inputs", program.inputs), ("targets", program.targets)):
        for name in names:
            if name not in values:
                raise SchedulingError(f"the program's {what} name value {name!r}, which the program does not have")
    for seg in program.segments:
        for name in (*seg.inputs, *seg.outputs):
            if name not in values:
                raise SchedulingError(f"segment {seg.id} uses value {name!r}, which the program does not have")
    for comm in program.communicators:
        _ranks(program, f"communicator {comm.id!r}", comm.ranks)
    for sid, devices in program.placement:
        segment("the placement", sid)
        _ranks(program, f"the placement of segment {sid}", devices, empty_ok=True)
    for rep in program.replication:
        segment("a replication", rep.segment)
        _ranks(program, f"the replication of segment {rep.segment}", rep.devices)
        if rep.zero not in (0, 1, 2, 3) or rep.bucket_bytes < 1:
            raise SchedulingError(
                f"the replication of segment {rep.segment} has ZeRO level {rep.zero} and bucket size "
                f"{rep.bucket_bytes}; the level is 0-3 and the size positive"
            )
    for b in program.buckets:
        segment(f"bucket {b.id}", b.segment)
        _ranks(program, f"bucket {b.id}", b.devices, empty_ok=True)
        if b.numel < 1 or b.shards < 1:
            raise SchedulingError(f"bucket {b.id} has {b.numel} elements in {b.shards} shards; both must be positive")
        params = {name for name, _ in segments[b.segment].params}
        for name in b.params:
            if name not in params:
                raise SchedulingError(f"bucket {b.id} holds parameter {name!r}, which segment {b.segment} does not have")
        for m in b.mirrors:
            if m not in buckets:
                raise SchedulingError(f"bucket {b.id} mirrors bucket {m!r}, which the program does not have")
    _unique("ties", (t.name for t in program.ties))
    for tie in program.ties:
        if len({seg for seg, _ in tie.holders}) < 2:
            raise SchedulingError(f"tie {tie.name!r} names fewer than two segments: {list(tie.holders)}")
        for seg, qualname in tie.holders:
            segment(f"tie {tie.name!r}", seg)
            if qualname not in dict(segments[seg].params):
                raise SchedulingError(f"tie {tie.name!r} names parameter {qualname!r}, which segment {seg} does not have")
        _check_tie_summed(program, tie)
    if program.precision is not None:
        for what in ("compute", "master"):
            dtype = getattr(program.precision, what)
            if dtype not in FLOAT_DTYPES:
                raise SchedulingError(f"the program's {what} precision {dtype!r} is not one of {sorted(FLOAT_DTYPES)}")
    for sh in program.sharding:
        segment("a sharding", sh.segment)
        _ranks(program, f"the sharding of segment {sh.segment}", sh.devices)
        params = {name for name, _ in segments[sh.segment].params}
        for p in sh.params:
            if p.name not in params:
                raise SchedulingError(
                    f"the sharding of segment {sh.segment} cuts parameter {p.name!r}, which segment {sh.segment} does not have"
                )
        if sh.degree < 1 or len(sh.devices) % sh.degree or sh.collectives < 0:
            raise SchedulingError(
                f"the sharding of segment {sh.segment} has degree {sh.degree} over {len(sh.devices)} devices and "
                f"{sh.collectives} collectives; the degree must divide the devices, the count be non-negative"
            )


def _check_tie_summed(program: Program, tie: Tie) -> None:
    """A tie whose copies are replicas of one another on several ranks must sit, on each of
    them, in a bucket of its own (a tie bucket, ``piper_memory.plan_memory``), which the
    plan's collectives sum; otherwise each rank would train its own copy. Copies at different
    positions of a tensor-parallel group are not replicas: each position computes the whole
    gradient (``_tie_families``), so holders that share one rank per position need none."""
    ranks = sorted({r for family in _tie_families(program, tie) if len(family) > 1 for r in family})
    if not ranks:
        return
    held = set(tie.holders)
    covered = {r for b in program.buckets if len(b.params) == 1 and (b.segment, b.params[0]) in held for r in b.devices}
    if missing := [r for r in ranks if r not in covered]:
        raise SchedulingError(
            f"tie {tie.name!r} is held on ranks {ranks}, but no bucket of its own sums its gradient on ranks "
            f"{missing}; run piper_memory.plan_memory before compile_program"
        )


def _tie_families(program: Program, tie: Tie) -> list[set[int]]:
    """The sets of ranks over which a tie's copies are replicas of one another, as
    ``piper_memory.ties`` groups them: per tensor-parallel position where its holders are
    tensor-parallel (``Sharding.holders``), else every rank holding one. Holders
    tensor-parallel to different degrees (which the planner refuses) count as one set."""
    placement = dict(program.placement)
    sharding = {s.segment: s for s in program.sharding}
    per_holder = []
    for seg, _ in tie.holders:
        sh = sharding.get(seg)
        tp = sh is not None and sh.kind is ShardKind.TP
        per_holder.append([set(sh.holders(t)) for t in range(sh.degree)] if tp else [set(placement.get(seg, ()))])
    if len({len(families) for families in per_holder}) > 1:
        return [set().union(*(f for families in per_holder for f in families))]
    return [set().union(*(families[t] for families in per_holder)) for t in range(len(per_holder[0]))]


def _problem(
    program: Program, buckets: dict[str, Bucket], placement: dict[str, tuple[int, ...]], rank: int, ins: Instruction
) -> str | None:
    """What is wrong with the references of ``ins`` on ``rank``, or None."""
    if not ins.stream:
        return "has an empty stream name"
    if ins.segment is not None and ins.segment not in program.segment_by_id:
        return f"names segment {ins.segment!r}, which the program does not have"
    if ins.microbatch is not None and not 0 <= ins.microbatch < program.microbatches:
        return f"has microbatch {ins.microbatch}, outside [0, {program.microbatches})"
    if ins.meta is not None and min(ins.meta.shape, default=0) < 0:  # no negative dimension
        return f"has a negative dimension in its meta {list(ins.meta.shape)}"
    if ins.overlap is not None and ins.overlap < 0:
        return f"has overlap number {ins.overlap}; overlap numbers are non-negative"
    if ins.kind in COMPUTE_KINDS:
        return _compute_problem(ins, placement, rank)
    if ins.kind in POINT_TO_POINT_KINDS:
        if ins.value is None:
            return "carries no value"
        if ins.value not in program.value_by_name:
            return f"carries value {ins.value!r}, which the program does not have"
        if ins.meta is None:
            return "has no meta: the shape and dtype that travel"
    if ins.kind in BUCKET_KINDS:
        return _bucket_problem(ins, buckets)
    return None


def _compute_problem(ins: Instruction, placement: dict[str, tuple[int, ...]], rank: int) -> str | None:
    if ins.segment is None:
        return f"is a {ins.kind.value} step without a segment"
    if ins.kind is COMPUTE and ins.phase not in COMPUTE_PHASES:
        return f"has phase {ins.phase and ins.phase.value}; compute runs F, B, BI or BW"
    if ins.kind is OPTIMIZER and ins.phase is not Phase.OPT:
        return f"has phase {ins.phase and ins.phase.value}; an optimizer step has phase OPT"
    devices = placement.get(ins.segment)
    if devices is not None and rank not in devices:
        return f"runs segment {ins.segment}, which the program places on ranks {list(devices)}"
    return None


def _bucket_problem(ins: Instruction, buckets: dict[str, Bucket]) -> str | None:
    bucket = buckets.get(ins.value or "")
    if bucket is None:
        return f"names bucket {ins.value!r}, which the program does not have"
    if ins.segment is not None and ins.segment != bucket.segment:
        return f"names segment {ins.segment} but bucket {bucket.id} holds parameters of segment {bucket.segment}"
    if ins.meta is None:
        return "has no meta: the flat bucket it moves"
    # What compile_program gives a bucket operation: the padded bucket, one shard for an
    # all-reduce (a mirror sum of a sharded bucket; unsharded, both sizes are the same).
    numel = bucket.shard_numel if ins.kind is NodeKind.ALL_REDUCE else bucket.padded_numel
    if ins.meta.numel() != numel:
        return f"moves {ins.meta.numel()} elements but bucket {bucket.id} has {numel}"
    return None
