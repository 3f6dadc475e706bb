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

import attrs
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


def check_dtypes(
    program: Program, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Map batch value names to tensors, raising ``ValueError`` on a dtype unlike the
    program's (after ``cut_batch``, which checks the rest: any batch size and other dimensions)."""
    batch: dict[str, torch.Tensor] = {}
    for name, tensor in zip((*program.inputs, *program.targets), (*inputs, *targets), strict=True):
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype != program.value_by_name[name].meta.dtype:
            raise ValueError(f"{name}: expected dtype {program.value_by_name[name].meta.dtype}, got {dtype}")
        batch[name] = tensor
    return batch


def split_microbatches(
    tensor: torch.Tensor, meta: TensorMeta, microbatches: int, sizes: Sequence[int] | None = None
) -> tuple[torch.Tensor, ...]:
    """``microbatches`` equal chunks along ``meta.batch_dim`` (the whole tensor for each
    microbatch when the value has no batch dimension); ``sizes``: chunks of these sizes
    instead (a batch that does not divide evenly: ``BatchCut``)."""
    if meta.batch_dim is None:
        return (tensor,) * microbatches
    if sizes is not None:
        return tuple(torch.split(tensor, list(sizes), dim=meta.batch_dim))
    size = tensor.shape[meta.batch_dim]
    if size % microbatches:
        raise ValueError(f"batch size {size} is not divisible by {microbatches} microbatches")
    return tuple(torch.tensor_split(tensor, microbatches, dim=meta.batch_dim))


def replica_slice(
    tensor: torch.Tensor, meta: TensorMeta, microbatches: int, replicas: int, replica: int,
    sizes: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """What replica ``replica`` reads of a whole-batch tensor: shard ``replica`` of each of the
    ``microbatches`` chunks, concatenated along ``meta.batch_dim`` (the tensor itself with one
    replica or no batch dimension). ``sizes``: ``BatchCut.sizes``, the pieces of a batch that
    does not divide evenly (equal chunks without it)."""
    if replicas == 1 or meta.batch_dim is None:
        return tensor
    dim = meta.batch_dim
    if sizes is not None:
        chunks = torch.split(tensor, [sum(row) for row in sizes], dim=dim)
        return torch.cat([torch.split(c, list(row), dim=dim)[replica] for c, row in zip(chunks, sizes, strict=True)],
                         dim=dim)
    if tensor.shape[dim] % (microbatches * replicas):
        raise ValueError(
            f"batch size {tensor.shape[dim]} is not divisible by {microbatches} microbatches x {replicas} replicas"
        )
    shards = [
        torch.tensor_split(chunk, replicas, dim=dim)[replica]
        for chunk in torch.tensor_split(tensor, microbatches, dim=dim)
    ]
    return torch.cat(shards, dim=dim)


def piece_sizes(samples: int, microbatches: int, replicas: int = 1) -> tuple[tuple[int, ...], ...]:
    """How many samples each piece of a batch of ``samples`` holds, ``[microbatch][replica]``:
    the batch cut into ``microbatches`` chunks, each into ``replicas`` shards, as
    ``torch.tensor_split`` cuts (the first ``samples % parts`` parts one larger)."""

    def cut(n: int, parts: int) -> list[int]:
        q, r = divmod(n, parts)
        return [q + 1 if k < r else q for k in range(parts)]

    return tuple(tuple(cut(chunk, replicas)) for chunk in cut(samples, microbatches))


def loss_divisors(sizes: Sequence[Sequence[int]]) -> tuple[tuple[float, ...], ...]:
    """What each piece's loss is divided by for backward, ``[microbatch][replica]``: the
    batch's samples over the piece's, so a mean-reduced loss's gradient, summed over the
    pieces, is the whole batch's mean. With equal pieces it is ``microbatches * replicas``,
    exactly (the division by that count the program's pieces always had)."""
    total = sum(sum(row) for row in sizes)
    return tuple(tuple(total / n for n in row) for row in sizes)


def weighted_losses(
    losses: Sequence[Sequence[float]], sizes: Sequence[Sequence[int]]
) -> tuple[tuple[float, ...], float]:
    """Each microbatch's loss and the batch's from the pieces' losses ``[microbatch][replica]``
    of a batch cut into ``sizes`` (``piece_sizes``): each a mean weighted by samples, so a
    mean-reduced loss gives the whole batch's mean whatever the cut (equal pieces: plain means,
    as the losses of a batch that divides evenly always were)."""
    if len({n for row in sizes for n in row}) == 1:
        plain = tuple(sum(ls) / len(ls) for ls in losses)
        return plain, sum(plain) / len(plain)
    per_mb = tuple(sum(n * v for n, v in zip(row, ls, strict=True)) / sum(row)
                   for ls, row in zip(losses, sizes, strict=True))
    total = sum(sum(row) for row in sizes)
    return per_mb, sum(sum(row) * v for v, row in zip(per_mb, sizes, strict=True)) / total


Signature = tuple[tuple[int, ...], ...]  # the shapes of one piece's batch values, in program order


@attrs.frozen
class BatchCut:
    """How one batch is cut into the program's pieces (``cut_batch``): ``sizes[m][j]``, the
    samples of microbatch ``m``'s shard ``j``; ``signatures[m][j]``, the shapes that piece's
    batch values have (inputs, then targets, in program order); ``total``, the batch's samples."""

    sizes: tuple[tuple[int, ...], ...]
    signatures: tuple[tuple[Signature, ...], ...]
    total: int

    def even(self, program: Program) -> bool:
        """Whether every piece has the program's own shapes (the batch it was compiled for)."""
        own = program_signature(program)
        return all(s == own for row in self.signatures for s in row)

    def distinct(self) -> list[Signature]:
        """The pieces' signatures, each once, in order of first appearance."""
        return list(dict.fromkeys(s for row in self.signatures for s in row))

    def piece(self, tensor: torch.Tensor, meta: TensorMeta, microbatch: int, replica: int) -> torch.Tensor:
        """Microbatch ``microbatch``'s shard ``replica`` of a whole-batch tensor."""
        if meta.batch_dim is None:
            return tensor
        chunk = torch.split(tensor, [sum(row) for row in self.sizes], dim=meta.batch_dim)[microbatch]
        return torch.split(chunk, list(self.sizes[microbatch]), dim=meta.batch_dim)[replica]


def program_signature(program: Program) -> Signature:
    """The shapes of one piece's batch values in ``program`` (its compiled-for signature)."""
    return tuple(tuple(program.value_by_name[n].meta.shape) for n in (*program.inputs, *program.targets))


def describe_signature(program: Program, signature: Signature) -> str:
    """``input:0 2x24, target:0 2x24``: a signature by value name."""
    names = (*program.inputs, *program.targets)
    return ", ".join(f"{n} {'x'.join(map(str, s)) or 'scalar'}" for n, s in zip(names, signature, strict=True))


def cut_batch(program: Program, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> BatchCut:
    """How ``program`` cuts a whole batch into ``microbatches x replicas`` pieces, whatever its
    size and its other dimensions: ``ValueError`` for a count of tensors unlike the program's,
    batch values that disagree on the batch's size, or a batch too small to give every piece
    a sample. Dtypes are ``check_batch``'s to check."""
    for what, names, given in (("inputs", program.inputs, inputs), ("targets", program.targets, targets)):
        if isinstance(given, torch.Tensor):
            raise ValueError(f"{what} must be a tuple of tensors (one per {list(names)}), got a tensor")
        if len(given) != len(names):
            raise ValueError(f"the program takes {len(names)} {what} {list(names)}, got {len(given)}")
    names = (*program.inputs, *program.targets)
    tensors = (*inputs, *targets)
    samples: int | None = None
    for name, tensor in zip(names, tensors, strict=True):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        meta = program.value_by_name[name].meta
        if tensor.dim() != len(meta.shape):
            raise ValueError(f"{name}: expected {len(meta.shape)} dimensions (shape {full_batch_shape(meta, program.microbatches, program.replicas)}), got shape {tuple(tensor.shape)}")
        if meta.batch_dim is None:
            continue
        n = tensor.shape[meta.batch_dim]
        if samples is not None and n != samples:
            raise ValueError(f"{name}: a batch of {n} samples along dim {meta.batch_dim}, the batch's other values have "
                             f"{samples}")
        samples = n
    pieces = program.microbatches * program.replicas
    if samples is None:
        samples = pieces  # nothing to cut: every piece reads the whole values
    if samples < pieces:
        replicas = f" x {program.replicas} replicas" if program.replicas > 1 else ""
        raise ValueError(f"a batch of {samples} samples cannot give each of {program.microbatches} "
                         f"microbatches{replicas} a sample")
    sizes = piece_sizes(samples, program.microbatches, program.replicas)
    metas = [program.value_by_name[n].meta for n in names]

    def shape(tensor: torch.Tensor, meta: TensorMeta, n: int) -> tuple[int, ...]:
        out = list(tensor.shape)
        if meta.batch_dim is not None:
            out[meta.batch_dim] = n
        return tuple(out)

    by_size = {n: tuple(shape(t, m, n) for t, m in zip(tensors, metas, strict=True))
               for n in {n for row in sizes for n in row}}
    return BatchCut(sizes, tuple(tuple(by_size[n] for n in row) for row in sizes), samples)


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
    program: Program, batch: Mapping[str, Any], device: torch.device, sizes: Sequence[int] | None = None
) -> dict[str, tuple[torch.Tensor, ...]]:
    """What a rank received of a batch (``to_wire`` values, or Ray object refs to them, which
    are fetched), on ``device``, each value split into ``program``'s microbatches (of
    ``sizes`` samples each, where given: ``RankLayout``)."""
    return {
        name: split_microbatches(
            from_wire(_fetched(value)).to(device), program.value_by_name[name].meta, program.microbatches, sizes
        )
        for name, value in batch.items()
    }


def _fetched(value: Any) -> Any:
    if isinstance(value, torch.Tensor | np.ndarray):
        return value
    import ray  # a reference: only when running under Ray

    return ray.get(value, timeout=300)
