"""Batches: checking them against the program and cutting them into microbatches.

With data parallelism (``Program.replicas`` = N > 1) the batch is cut into ``microbatches``
chunks first, then each chunk into N equal shards; replica ``j`` computes shard ``j`` of every
microbatch (docs/ir-conventions.md, section 7). The driver ships replica ``j`` only its shards,
concatenated (``replica_slice``), so the worker's ``split_microbatches`` of what it receives
gives exactly shard ``j`` of each microbatch.

On the way to a worker a host tensor travels as a NumPy array (``to_wire``/``from_wire``):
Ray pickles an array's buffer out of band, in about a fifth of the time torch's pickling of
a tensor takes (which goes through ``torch.save`` per storage), on the driver and again on
the worker, every step. Tensors NumPy cannot hold (bfloat16, devices) travel as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from piper_ir import NodeKind, Phase, Program, TensorMeta


def to_wire(tensor: torch.Tensor) -> Any:
    """What the driver ships for ``tensor`` (module doc)."""
    if tensor.device.type != "cpu":
        return tensor
    try:
        return tensor.detach().numpy()
    except (TypeError, RuntimeError):  # a dtype NumPy has no type for (bfloat16, float8, ...)
        return tensor


def from_wire(value: Any) -> torch.Tensor:
    """The tensor ``to_wire`` shipped (a writable copy where Ray hands over a read-only
    buffer)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value if value.flags.writeable else value.copy())
    return value


def full_batch_shape(meta: TensorMeta, microbatches: int, replicas: int = 1) -> tuple[int, ...]:
    """The shape a whole batch of a value has, given its (already split) meta of one shard of
    one microbatch."""
    shape = list(meta.shape)
    if meta.batch_dim is not None:
        shape[meta.batch_dim] *= microbatches * replicas
    return tuple(shape)


def check_batch(
    program: Program, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Map batch value names to tensors, raising ``ValueError`` on a count, shape or dtype
    mismatch with the program's value metas (× microbatches × replicas along ``batch_dim``)."""
    for what, names, given in (("inputs", program.inputs, inputs), ("targets", program.targets, targets)):
        if isinstance(given, torch.Tensor):
            raise ValueError(f"{what} must be a tuple of tensors (one per {list(names)}), got a tensor")
        if len(given) != len(names):
            raise ValueError(f"the program takes {len(names)} {what} {list(names)}, got {len(given)}")
    batch: dict[str, torch.Tensor] = {}
    for name, tensor in zip((*program.inputs, *program.targets), (*inputs, *targets), strict=True):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        meta = program.value_by_name[name].meta
        expected = full_batch_shape(meta, program.microbatches, program.replicas)
        if tuple(tensor.shape) != expected:
            replicas = f" x {program.replicas} replicas" if program.replicas > 1 else ""
            raise ValueError(
                f"{name}: expected shape {expected} (microbatch shape {meta.shape} x "
                f"{program.microbatches} microbatches{replicas} along dim {meta.batch_dim}), "
                f"got {tuple(tensor.shape)}"
            )
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype != meta.dtype:
            raise ValueError(f"{name}: expected dtype {meta.dtype}, got {dtype}")
        batch[name] = tensor
    return batch


def split_microbatches(tensor: torch.Tensor, meta: TensorMeta, microbatches: int) -> tuple[torch.Tensor, ...]:
    """``microbatches`` equal chunks along ``meta.batch_dim`` (the whole tensor for each
    microbatch when the value has no batch dimension)."""
    if meta.batch_dim is None:
        return (tensor,) * microbatches
    size = tensor.shape[meta.batch_dim]
    if size % microbatches:
        raise ValueError(f"batch size {size} is not divisible by {microbatches} microbatches")
    return tuple(torch.tensor_split(tensor, microbatches, dim=meta.batch_dim))


def replica_slice(
    tensor: torch.Tensor, meta: TensorMeta, microbatches: int, replicas: int, replica: int
) -> torch.Tensor:
    """What replica ``replica`` reads of a whole-batch tensor: shard ``replica`` of each of the
    ``microbatches`` chunks, concatenated along ``meta.batch_dim`` (the tensor itself with one
    replica or no batch dimension)."""
    if replicas == 1 or meta.batch_dim is None:
        return tensor
    dim = meta.batch_dim
    if tensor.shape[dim] % (microbatches * replicas):
        raise ValueError(
            f"batch size {tensor.shape[dim]} is not divisible by {microbatches} microbatches x {replicas} replicas"
        )
    shards = [
        torch.tensor_split(chunk, replicas, dim=dim)[replica]
        for chunk in torch.tensor_split(tensor, microbatches, dim=dim)
    ]
    return torch.cat(shards, dim=dim)


def batch_reads(program: Program, rank: int) -> tuple[str, ...]:
    """The batch values rank ``rank`` reads: its forwards' inputs and what it sends (only
    those are shipped to it)."""
    batch = set(program.inputs) | set(program.targets)
    reads: dict[str, None] = {}
    for ins in program.plan(rank).instructions:
        if ins.kind is NodeKind.COMPUTE and ins.phase is Phase.F:
            names = program.segment_by_id[ins.segment].inputs
        elif ins.kind is NodeKind.SEND:
            names = (ins.value,)
        else:
            continue
        for n in names:
            if n in batch:
                reads.setdefault(n, None)
    return tuple(reads)


def received_microbatches(
    program: Program, batch: Mapping[str, Any], device: torch.device
) -> dict[str, tuple[torch.Tensor, ...]]:
    """What a rank received of a batch (``to_wire`` values, or Ray object refs to them, which
    are fetched), on ``device``, each value split into ``program``'s microbatches."""
    return {
        name: split_microbatches(
            from_wire(_fetched(value)).to(device), program.value_by_name[name].meta, program.microbatches
        )
        for name, value in batch.items()
    }


def _fetched(value: Any) -> Any:
    if isinstance(value, torch.Tensor | np.ndarray):
        return value
    import ray  # a reference: only when running under Ray

    return ray.get(value, timeout=300)
