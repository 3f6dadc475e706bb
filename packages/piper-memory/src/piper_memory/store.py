"""The flat-buffer shard store: how a runtime lays a ``Bucket``'s tensors out in memory.

This is the only torch-side module of piper-memory (import it as ``piper_memory.store``; the
package itself stays importable without torch). A ``BucketLayout`` binds a ``piper_ir.Bucket``
to the shapes of its parameters and answers the questions a ZeRO runtime asks:

- ``flatten(tensors)``: the bucket's tensors concatenated in ``Bucket.params`` order into one
  buffer of ``padded_numel`` elements, the tail zero-filled so every replica's shard has the
  same length (the collectives need equal chunks);
- ``shard_range(j)`` / ``shard(flat, j)``: replica ``j``'s range ``[j * shard_numel,
  (j + 1) * shard_numel)`` of the padded buffer and a view of it;
- ``unflatten(flat)``: views of the buffer with each parameter's shape (no copy), and
  ``copy_into(flat, tensors)`` to copy it back into existing tensors;
- ``assemble(shards)``: the padded buffer from every replica's shard (driver side, where
  shards come back from the ranks).

``accumulate_grad(param, grad)`` is the gradient-shard accumulator: a ZeRO-2/3 replica adds
each microbatch's reduce-scattered shard into the ``.grad`` of its parameter shard.
``shard_tensor`` / ``unshard_tensors`` cut a tensor-parallel parameter into a rank's shard
(``piper_ir.ParamShard``) and put the shards back together (driver side).
Padding elements are zero in every buffer built here; an optimizer step keeps them zero
(zero gradient, zero weight), so they never leak into parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from piper_ir import Bucket, ParamShard, TensorMeta


@attrs.frozen
class BucketLayout:
    """A ``Bucket`` with the shape of each of its parameters (in ``bucket.params`` order)."""

    bucket: Bucket
    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=lambda s: tuple(tuple(x) for x in s))

    def __attrs_post_init__(self) -> None:
        if len(self.shapes) != len(self.bucket.params):
            raise ValueError(
                f"{self.bucket.id}: {len(self.shapes)} shapes for {len(self.bucket.params)} parameters"
            )
        if sum(self.numels) != self.bucket.numel:
            raise ValueError(
                f"{self.bucket.id}: parameters hold {sum(self.numels)} elements, the bucket says {self.bucket.numel}"
            )

    @classmethod
    def from_metas(cls, bucket: Bucket, metas: Mapping[str, TensorMeta]) -> BucketLayout:
        """The layout from parameter metas by qualified name (e.g. ``dict(Segment.params)``)."""
        return cls(bucket, [metas[name].shape for name in bucket.params])

    @classmethod
    def from_tensors(cls, bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> BucketLayout:
        """The layout from live tensors by qualified name (e.g. ``dict(module.named_parameters())``)."""
        return cls(bucket, [tuple(tensors[name].shape) for name in bucket.params])

    @property
    def numels(self) -> tuple[int, ...]:
        out = []
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            out.append(n)
        return tuple(out)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the flat buffer."""
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.bucket.dtype)

    def shard_range(self, replica: int) -> tuple[int, int]:
        """``[start, stop)`` of replica ``replica``'s shard in the padded buffer."""
        if not 0 <= replica < self.bucket.shards:
            raise ValueError(
                f"{self.bucket.id}: replica {replica} out of range for {self.bucket.shards} shards"
            )
        n = self.bucket.shard_numel
        return replica * n, (replica + 1) * n

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """An uninitialised padded buffer of the bucket's dtype."""
        return torch.empty(self.bucket.padded_numel, dtype=self.dtype, device=device)

    def flatten(
        self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tensors (``None`` counts as zeros) concatenated into a zero-padded flat buffer
        of ``padded_numel`` elements (written into ``out`` when given)."""
        if len(tensors) != len(self.shapes):
            raise ValueError(f"{self.bucket.id}: {len(tensors)} tensors for {len(self.shapes)} parameters")
        if out is None:
            device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
            out = self.empty(device)
        for t, shape, start, n in zip(tensors, self.shapes, self.offsets, self.numels, strict=True):
            if t is None:
                out[start : start + n].zero_()
                continue
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{self.bucket.id}: expected a tensor of shape {shape}, got {tuple(t.shape)}"
                )
            out[start : start + n].copy_(t.detach().reshape(-1))
        out[self.bucket.numel :].zero_()
        return out

    def unflatten(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of ``flat`` (padded or not) with each parameter's shape; no copy."""
        if flat.numel() < self.bucket.numel:
            raise ValueError(
                f"{self.bucket.id}: flat buffer of {flat.numel()} elements < {self.bucket.numel}"
            )
        return tuple(
            flat[start : start + n].view(shape)
            for shape, start, n in zip(self.shapes, self.offsets, self.numels, strict=True)
        )

    def copy_into(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the flat buffer back into existing tensors of the parameters' shapes."""
        with torch.no_grad():
            for dst, src in zip(tensors, self.unflatten(flat), strict=True):
                dst.copy_(src)

    def shard(self, flat: torch.Tensor, replica: int) -> torch.Tensor:
        """A view of replica ``replica``'s shard of the padded buffer ``flat``."""
        if flat.numel() != self.bucket.padded_numel:
            raise ValueError(
                f"{self.bucket.id}: expected a padded buffer of {self.bucket.padded_numel} elements, got {flat.numel()}"
            )
        start, stop = self.shard_range(replica)
        return flat[start:stop]

    def assemble(self, shards: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The padded buffer from one shard per replica (``replica -> shard``)."""
        missing = sorted(set(range(self.bucket.shards)) - set(shards))
        if missing:
            raise ValueError(f"{self.bucket.id}: no shard from replicas {missing}")
        for j, s in shards.items():
            if s.numel() != self.bucket.shard_numel:
                raise ValueError(
                    f"{self.bucket.id}: shard of replica {j} has {s.numel()} elements, expected {self.bucket.shard_numel}"
                )
        return torch.cat([shards[j].reshape(-1) for j in range(self.bucket.shards)])


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad`` (taking ``grad`` itself when there is none yet)."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def shard_tensor(t: torch.Tensor, spec: ParamShard, degree: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor ``t`` under ``spec`` (tensor parallelism,
    ``piper_ir.Sharding``): a new contiguous tensor."""
    pieces = spec.pieces(t.shape[spec.dim], degree, rank)
    return torch.cat([t.narrow(spec.dim, a, n) for a, n in pieces], spec.dim).contiguous()


def unshard_tensors(shards: Mapping[int, torch.Tensor], spec: ParamShard, degree: int) -> torch.Tensor:
    """The full tensor from every rank's shard (``shard_tensor`` inverted)."""
    if sorted(shards) != list(range(degree)):
        raise ValueError(f"{spec.name}: need the shards of ranks 0..{degree - 1}, got {sorted(shards)}")
    piece = shards[0].shape[spec.dim] // spec.groups
    return torch.cat(
        [shards[r].narrow(spec.dim, g * piece, piece) for g in range(spec.groups) for r in range(degree)], spec.dim
    )
