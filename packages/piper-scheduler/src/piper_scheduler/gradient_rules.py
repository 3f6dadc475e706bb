"""``verify``'s rules about gradients and steps, rank by rank (``semantics`` lists them all).

- ``[optimizer after backward]``: a rank computing gradients of a segment with parameters
  runs its step once, after all of them (for a tied parameter, the owner's step, the first
  holder's on the rank, after every holder's); one gradient norm per rank where the program
  has a ``GradNorm``, before every step; a reduction of a bucket after the gradients it
  reduces (its microbatch's, or all) and before the step; an all-gather after the step.
- ``[gradients after reduce-scatter]``: a weight-gradient pass listed after a reduce-scatter
  of its segment's bucket waits for it (the reduce-scatter drops the full gradients the pass
  would add to; the runtime relies on it, ``piper_runtime.rank.compute``).
- ``[gathered parameters]``: a pass of a segment whose bucket keeps its parameters sharded
  runs after the ``MATERIALIZE`` of that bucket listed last before it, with no ``FREE`` of
  it listed in between, and before the ``FREE`` listed next.

A tied parameter's bucket takes every holder's gradients and serves every holder's passes,
and no instruction says which holder's: only its place before the step is checked. In an
evaluation program (no backward, no step) only the gathers have anything to check.
"""

from __future__ import annotations

from bisect import bisect_left

from piper_ir import NodeKind, Phase, Program, Residency
from piper_scheduler.diagnostics import describe
from piper_scheduler.kinds import PHASE_OPT
from piper_scheduler.plan_index import RankIndex, Tables, fail

WEIGHT_GRADS = (Phase.B, Phase.BW)  # passes that yield the gradients of a segment's parameters
STEP = "optimizer after backward"


def check_gradients(program: Program, tables: Tables, rank: RankIndex) -> None:
    """Raise ``SchedulingError`` where ``rank`` breaks a rule (module doc)."""
    _check_steps(program, rank)
    _check_group_operations(program, tables, rank)


def _check_steps(program: Program, rank: RankIndex) -> None:
    passes, r = rank.passes, rank.rank
    owner: dict[str, str] = {}  # holder segment -> the segment whose step updates the tie here
    for tie in program.ties:
        here = [seg for seg, _ in tie.holders if seg in rank.weight_grads or (seg, PHASE_OPT, None) in passes]
        for seg in here:
            owner.setdefault(seg, here[0])
    for seg in program.segments:
        grads = rank.weight_grads.get(seg.id)
        if not grads or not seg.params:
            continue
        for stepper in dict.fromkeys((seg.id, owner.get(seg.id, seg.id))):
            opt = passes.get((stepper, PHASE_OPT, None))
            if opt is None:
                fail(program, STEP, f"{describe(program, r, grads[-1])} computes gradients of segment {seg.id}'s "
                     f"parameters, but rank {r} never runs the optimizer step {stepper}:OPT", [(r, grads[-1])])
            for j in grads:
                rank.after(STEP, j, opt, "which computes gradients it steps")
    norms = [i for i in rank.groups if rank.plan.instructions[i].kind is NodeKind.GRAD_NORM]
    if program.grad_norm is not None and len(norms) != 1:
        fail(program, STEP, f"rank {r} runs {len(norms)} gradient norms; a program with a GradNorm runs one per "
             "rank, before its steps", [(r, i) for i in norms], [r])
    steps = [i for key, i in passes.items() if key[1] is PHASE_OPT]
    for i in norms:
        for j in steps:
            rank.after(STEP, i, j, "the gradient norm, which precedes every step")


def _check_group_operations(program: Program, tables: Tables, rank: RankIndex) -> None:
    passes, instructions = rank.passes, rank.plan.instructions
    scatters: dict[str, list[int]] = {}  # segment -> its reduce-scatters here, in list order
    gathers: dict[str, tuple[list[int], list[int]]] = {}  # bucket -> its materializes, frees
    for i in rank.groups:
        ins = instructions[i]
        bucket = tables.buckets.get(ins.value or "")
        if bucket is None:
            continue  # a gradient norm
        seg = bucket.segment
        tied = any((seg, p) in tables.tied for p in bucket.params)
        opt = passes.get((seg, PHASE_OPT, None))
        kind = ins.kind
        if kind is NodeKind.ALL_GATHER:
            if opt is not None:
                rank.after(STEP, opt, i, f"the step of {seg} whose shards it gathers")
        elif kind is NodeKind.ALL_REDUCE or kind is NodeKind.REDUCE_SCATTER:
            if not tied:
                grads = rank.weight_grads.get(seg, [])
                if ins.microbatch is not None:
                    grads = [passes[k] for k in ((seg, p, ins.microbatch) for p in WEIGHT_GRADS) if k in passes]
                for j in grads:
                    rank.after(STEP, j, i, "which computes gradients it reduces")
                if kind is NodeKind.REDUCE_SCATTER:
                    scatters.setdefault(seg, []).append(i)
            if opt is not None:
                rank.after(STEP, i, opt, f"the reduction of bucket {bucket.id}")
        elif not tied and bucket.params_home is Residency.SHARDED:  # MATERIALIZE or FREE
            gathers.setdefault(bucket.id, ([], []))[kind is NodeKind.FREE].append(i)
    for seg, indices in scatters.items():
        for j in rank.weight_grads.get(seg, ()):
            k = bisect_left(indices, j)  # the reduce-scatters listed before the pass
            if k:  # they share a stream: waiting for the last waits for all of them
                rank.after("gradients after reduce-scatter", indices[k - 1], j,
                           "the reduce-scatter that drops the gradients it adds to")
    for bucket_id, (materializes, frees) in gathers.items():
        seg = tables.buckets[bucket_id].segment
        for key, j in passes.items():
            if key[0] != seg or key[1] is PHASE_OPT:
                continue
            m, f = bisect_left(materializes, j), bisect_left(frees, j)
            if not m or (f and frees[f - 1] > materializes[m - 1]):
                fail(program, "gathered parameters", f"{describe(program, rank.rank, j)} uses the parameters of "
                     f"{bucket_id}, which rank {rank.rank} has not materialized (or freed again) before it",
                     [(rank.rank, j)])
            rank.after("gathered parameters", materializes[m - 1], j, f"which gathers the parameters of {bucket_id}")
            if f < len(frees):
                rank.after("gathered parameters", j, frees[f], f"a use of the parameters of {bucket_id}")
