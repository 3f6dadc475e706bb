"""What the driver makes of the ranks' answers: one ``StepResult``, one set of parameters.

Each rank reports what it holds: losses of the microbatches it ran the loss for, gradients
whole on it, gradient and parameter shards of buckets whose state lives sharded (by replica
index), tensor/expert-parallel pieces by position in the shard group. These functions put
them back together as single-device training would have them, by the program's metas
(``BucketLayout.assemble``, ``unshard_tensors``): replicas hold equal copies, so the first
is kept. A tied parameter is reported once, under ``Tie.name``, after its copies are checked
to be equal (``ties.untie``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from piper_ir import ExecutionError, Program
from piper_memory.store import BucketLayout, unshard_tensors
from piper_runtime.batch import weighted_losses
from piper_runtime.rank.ties import untie
from piper_runtime.results import StepOutput, StepResult


def merge_parameters(
    program: Program,
    per_rank: Sequence[Mapping[str, torch.Tensor]],
    shards: Sequence[Mapping[str, tuple[int, torch.Tensor]]],
) -> dict[str, torch.Tensor]:
    """Every parameter by qualified name from each rank's ``RankWorker.parameters()`` and
    ``parameter_shards()`` (in rank order)."""
    merged: dict[str, torch.Tensor] = {}
    # Every copy of a tied parameter, to check that none drifted (``ties.untie``).
    tied = {qualname: tie.name for tie in program.ties for _, qualname in tie.holders}
    copies: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for rank, params in enumerate(per_rank):
        for name, tensor in params.items():
            merged.setdefault(name, tensor)  # replicas hold equal copies; keep the first
            if name in tied:
                copies.setdefault(tied[name], []).append((f"{name} on rank {rank}", tensor))
    merged.update(_unshard_tp(program, list(enumerate(per_rank))))
    by_bucket: dict[str, dict[int, torch.Tensor]] = {}
    for held in shards:
        for bucket, (replica, shard) in held.items():
            by_bucket.setdefault(bucket, {})[replica] = shard
    # Parameters that live only as shards between steps (ZeRO-3): reassemble them, each
    # bucket of a tied parameter (one per group of its holders) on its own.
    tie_buckets = {b.id for b in program.buckets if len(b.params) == 1 and b.params[0] in tied}
    for bucket in sorted(tie_buckets & set(by_bucket)):
        ((name, tensor),) = _unshard(program, {bucket: by_bucket.pop(bucket)}).items()
        merged.setdefault(name, tensor)
        copies.setdefault(tied[name], []).append((f"{name} of {bucket}", tensor))
    merged.update(_unshard(program, by_bucket))
    untie(program, merged, copies)
    return merged


def merge_outputs(
    outputs: Sequence[StepOutput], program: Program, keep_grads: bool,
    sizes: Sequence[Sequence[int]] | None = None,
) -> StepResult:
    """One step's ``StepResult`` from every rank's ``StepOutput`` (in rank order). ``sizes``:
    the samples of each piece ``[microbatch][replica]`` of a batch cut unequally
    (``batch.BatchCut``): the losses are then means weighted by them (``weighted_losses``)."""
    per_mb: dict[int, list[float]] = {}
    by_replica: dict[int, dict[int, float]] = {}
    for out in outputs:
        for mb, loss in out.losses:
            per_mb.setdefault(mb, []).append(loss)
            by_replica.setdefault(mb, {})[program.plan(out.rank).replica] = loss
    # The loss of microbatch i is the mean over replicas of their shard losses.
    losses = tuple(sum(per_mb[i]) / len(per_mb[i]) for i in sorted(per_mb))
    if len(losses) != program.microbatches:
        raise ExecutionError(
            f"expected {program.microbatches} microbatch losses, the ranks reported {len(losses)}"
        )
    loss = sum(losses) / len(losses)
    if sizes is not None:
        pieces = [[by_replica[i][j] for j in range(len(sizes[i]))] for i in sorted(by_replica)]
        losses, loss = weighted_losses(pieces, sizes)
    grads: dict[str, torch.Tensor] | None = None
    if keep_grads:
        grads = {}
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for out in outputs:
            for name, g in (out.grads or {}).items():
                grads.setdefault(name, g)  # all-reduced: every replica holds the same sum
            for bucket, (replica, g) in (out.grad_shards or {}).items():
                shards.setdefault(bucket, {})[replica] = g
        grads.update(_unshard(program, shards))
        grads.update(_unshard_tp(program, [(out.rank, out.grads or {}) for out in outputs]))
        untie(program, grads)  # summed over the holders: every copy holds the same gradient
    timings = tuple(t for out in outputs for t in out.timings)
    memory = tuple(out.memory for out in outputs if out.memory is not None)
    # Every rank computed the same global norm; take the first.
    grad_norm = next((out.grad_norm for out in outputs if out.grad_norm is not None), None)
    return StepResult(
        losses,
        loss,
        grads,
        timings,
        tuple(out.seconds for out in outputs),
        memory,
        tuple(out.collective_seconds for out in outputs),
        grad_norm,
        worker_started=tuple(out.started for out in outputs),
        kernel_traces=tuple((out.rank, out.kernel_trace) for out in outputs if out.kernel_trace is not None),
        memory_timelines=tuple((out.rank, out.memory_timeline) for out in outputs if out.memory_timeline),
        cuda_snapshots=tuple((out.rank, out.cuda_snapshot) for out in outputs if out.cuda_snapshot is not None),
        compile_seconds=tuple(out.compile_seconds for out in outputs),
    )


def _unshard(program: Program, shards: Mapping[str, Mapping[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors by parameter name from every replica's shard of each bucket's flat buffer.
    A bucket of one shard position (``Bucket.devices``, data x tensor/expert parallelism)
    holds that position's pieces of the cut parameters: they are put together with the other
    positions' by ``_unshard_tp``."""
    buckets = {b.id: b for b in program.buckets}
    sharding = {s.segment: s for s in program.sharding}
    out: dict[str, torch.Tensor] = {}
    pieces: dict[int, dict[str, torch.Tensor]] = {}  # a rank holding the position -> its pieces
    for bucket_id, per_replica in shards.items():
        bucket = buckets[bucket_id]
        metas = dict(program.segment_by_id[bucket.segment].params)
        sh = sharding.get(bucket.segment) if bucket.devices else None
        if sh is not None:
            metas = {name: sh.local_meta(name, meta) for name, meta in metas.items()}
        layout = BucketLayout.from_metas(bucket, metas)
        flat = layout.assemble(per_replica)
        cut = {spec.name for spec in sh.params} if sh is not None else set()
        for name, view in zip(bucket.params, layout.unflatten(flat), strict=True):
            if name in cut:
                pieces.setdefault(bucket.devices[0], {})[name] = view.clone()
            else:
                out.setdefault(name, view.clone())  # uncut: every position holds the same
    out.update(_unshard_tp(program, list(pieces.items())))
    return out


def _unshard_tp(
    program: Program, per_rank: Sequence[tuple[int, Mapping[str, torch.Tensor]]]
) -> dict[str, torch.Tensor]:
    """Full tensors of tensor-parallel parameters from each rank's shard (``Sharding.params``);
    the ranks at one position of several data-parallel replicas hold equal shards."""
    out: dict[str, torch.Tensor] = {}
    for sh in program.sharding:
        for spec in sh.params:
            degree = sh.degree_of(spec)
            pieces = {
                sh.position(rank, degree): held[spec.name]
                for rank, held in per_rank
                if rank in sh.devices and spec.name in held
            }
            if pieces:
                out[spec.name] = unshard_tensors(pieces, spec, degree)
    return out
