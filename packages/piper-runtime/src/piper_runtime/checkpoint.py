"""Sharded checkpoints in ``torch.distributed.checkpoint`` (DCP) format: each rank writes what
it holds and reads what it needs, by the single-device parameter names (docs/checkpoints.md).

Keys (strategy-independent, so a checkpoint loads under any other strategy or on one device):

- ``model.<name>``: parameter (or buffer) ``<name>`` of the single-device model, its full shape;
- ``optim.<name>.<state>``: the optimizer state ``<state>`` (``exp_avg``, ``momentum_buffer``,
  ...) of that parameter, the parameter's shape; a scalar state (Adam's ``step``) is 0-d;
- objects the driver adds (the training loop's state), pickled by DCP, written by rank 0.

A rank holds whole parameters (and their optimizer state), or, in a bucket whose optimizer
state or parameters live sharded (ZeRO), a flat range of the bucket's buffer: pieces of
several parameters, each a contiguous range of a parameter's row-major elements. DCP stores
rectangular chunks, so a range is written as the few boxes that tile it (``flat_boxes``).
Replicas write equal boxes under equal keys, and DCP's global plan keeps one of each.

Saving goes through DCP's own planner and ``FileSystemWriter``, with Ray in place of its
collectives: each rank makes its local plan (``SaveSide.plan``), the driver makes the global
plan (``plan_globally``), each rank writes its files (``SaveSide.write``), the driver writes
``.metadata`` (``finish``). So no process group is needed (the ranks' gloo groups carry the
program's traffic), and the files are exactly what ``dcp.save`` writes. Loading is
``dcp.load`` on each rank on its own (``no_dist``): every rank reads the full tensors of the
parameters it holds (and their optimizer state) and keeps its part, so any layout reshards.

A parameter that tensor or expert parallelism cuts across ranks (``Sharding.params``) is held
as pieces of one dimension, concatenated (``ParamShard.pieces``; ``Cut``): a rank writes each
of its boxes split at the pieces' edges, at their offsets in the full tensor, and on loading
cuts its pieces out of the full tensor it read. So such a checkpoint too holds single-device
tensors, and loads under any strategy.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from piper_ir import ExecutionError, Program

MODEL = "model."
OPTIM = "optim."

# (name, shape, start, stop, at): elements [start, stop) of parameter ``name`` (row-major, of
# the tensor of ``shape`` the rank holds: a cut parameter's pieces, ``Cut``), held at
# [at, at + stop - start) of a flat tensor.
Slice = tuple[str, tuple[int, ...], int, int, int]
Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, first element's flat index)


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Rectangular boxes, in order, that tile elements ``[start, stop)`` of a row-major tensor
    of ``shape``; each box is itself a contiguous range (at most 2 per dimension)."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    if start % inner == 0 and stop % inner == 0:
        return [((start // inner, *(0,) * (len(shape) - 1)), (stop // inner - start // inner, *shape[1:]), start)]
    boxes: list[Box] = []
    row = start // inner
    if start % inner:  # a partial first row
        end = min(stop, (row + 1) * inner)
        for off, size, at in flat_boxes(shape[1:], start - row * inner, end - row * inner):
            boxes.append(((row, *off), (1, *size), row * inner + at))
        start, row = end, row + 1
    if start >= stop:
        return boxes
    last = stop // inner
    if last > row:  # whole rows
        boxes.append(((row, *(0,) * (len(shape) - 1)), (last - row, *shape[1:]), row * inner))
    if stop % inner:  # a partial last row
        for off, size, at in flat_boxes(shape[1:], 0, stop - last * inner):
            boxes.append(((last, *off), (1, *size), last * inner + at))
    return boxes


def _restrict(slices: Iterable[Slice], lo: int, hi: int) -> list[Slice]:
    """The slices of a flat tensor's elements ``[lo, hi)``, relative to ``lo``."""
    out: list[Slice] = []
    for name, shape, start, stop, at in slices:
        a, z = max(at, lo), min(at + stop - start, hi)
        if a < z:
            out.append((name, shape, start + a - at, start + z - at, a - lo))
    return out


@dataclass(frozen=True)
class Cut:
    """Where a rank's tensor of a tensor- or expert-parallel parameter lies in the full one:
    along ``dim`` it is the full tensor's ranges ``pieces`` (``(start, length)``, as
    ``ParamShard.pieces`` gives them) concatenated in order; ``full`` is the full shape."""

    dim: int
    pieces: tuple[tuple[int, int], ...]
    full: tuple[int, ...]

    def boxes(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[tuple[int, ...], int, int]]:
        """A box of the rank's tensor (its offsets and sizes there) as boxes of the full tensor:
        ``(full offsets, start, length)``, the box's entries ``[start, start + length)`` along
        ``dim`` (relative to the box) lying at those offsets."""
        lo, hi = offsets[self.dim], offsets[self.dim] + sizes[self.dim]
        out: list[tuple[tuple[int, ...], int, int]] = []
        at = 0  # where the piece starts in the rank's tensor
        for start, length in self.pieces:
            a, z = max(lo, at), min(hi, at + length)
            if a < z:
                full = list(offsets)
                full[self.dim] = start + a - at
                out.append((tuple(full), a - lo, z - a))
            at += length
        return out

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """The rank's tensor, cut out of the ``full`` one."""
        return torch.cat([full.narrow(self.dim, a, n) for a, n in self.pieces], self.dim)


def cuts_of(program: Program, rank: int, modules: Mapping[str, nn.Module]) -> dict[str, Cut]:
    """The ``Cut`` of each parameter of this rank's tensor- and expert-parallel segments, by
    name; ``modules`` hold the rank's pieces already (``sharding.cut_parameters``)."""
    cuts: dict[str, Cut] = {}
    for sh in program.sharding:
        if sh.segment not in modules or rank not in sh.devices:
            continue
        for spec in sh.params:
            full = list(modules[sh.segment].get_parameter(spec.name).shape)
            full[spec.dim] *= sh.degree
            pieces = spec.pieces(full[spec.dim], sh.degree, sh.position(rank))
            cuts[spec.name] = Cut(spec.dim, pieces, tuple(full))
    return cuts


class RankState:
    """What one rank holds of the model and optimizer state, as slices of single-device
    parameters (module doc). Built from the worker's modules, ``DataParallel`` and
    ``Optimizers`` after setup."""

    def __init__(self, program: Program, rank: int, modules: Mapping[str, nn.Module], data_parallel: Any,
                 optimizers: Any) -> None:
        self.cuts = cuts_of(program, rank, modules)
        # A tied parameter is one entry under its ``Tie.name``, whichever holder's name a rank
        # knows it by: a rank reads it back into every copy it holds.
        self.alias = {qualname: tie.name for tie in program.ties for _, qualname in tie.holders}
        self.modules = modules
        self.data_parallel = data_parallel
        self.optimizers = optimizers
        sharded = data_parallel.gathered_ids  # parameters that live only as bucket shards
        self.params: list[tuple[torch.Tensor, list[Slice]]] = []  # (flat tensor, its slices)
        self.full: dict[str, nn.Parameter] = {}  # parameters held whole, by name
        self.sharded_names: set[str] = set()
        slices_of: dict[int, list[Slice]] = {}
        for module in modules.values():
            for name, p in module.named_parameters():
                shape = tuple(p.shape)
                if id(p) in sharded:
                    self.sharded_names.add(name)
                    continue
                self.full[name] = p
                slices_of[id(p)] = [(name, shape, 0, p.numel(), 0)]
        for b in data_parallel.buckets.values():
            if b.shard is None:
                continue
            lo, hi = b.layout.shard_range(b.replica)
            held = [(n, s, 0, math.prod(s), at) for n, s, at in zip(b.bucket.params, b.layout.shapes, b.layout.offsets,
                                                                       strict=True)]
            slices_of[id(b.shard)] = _restrict(held, lo, hi)
            if b.params_sharded:
                self.params.append((b.shard, slices_of[id(b.shard)]))
        for pieces in optimizers.pieces.values():
            for piece, shard, start, stop in pieces:
                slices_of[id(piece)] = _restrict(slices_of[id(shard)], start, stop)
        self.params += [(p, slices_of[id(p)]) for p in self.full.values()]
        self.slices_of = slices_of
        self.buffers = {n: b for m in modules.values() for n, b in m.named_buffers()}

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """What this rank holds of parameter ``name`` (or of a state shaped like it), given
        the full tensor: its pieces if tensor or expert parallelism cuts it."""
        cut = self.cuts.get(name)
        return full if cut is None else cut.local(full)

    def key(self, name: str) -> str:
        """The checkpoint's name for parameter ``name`` (a tie's holders share one)."""
        return self.alias.get(name, name)

    def optimizer_params(self) -> list[tuple[torch.optim.Optimizer, torch.Tensor, list[Slice]]]:
        return [
            (opt, p, self.slices_of[id(p)])
            for opt in self.optimizers.by_segment.values()
            for group in opt.param_groups
            for p in group["params"]
        ]

    def pieces(self) -> dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.Tensor]]:
        """``(key, offsets) -> (full size, chunk)`` of everything this rank writes (CPU copies)."""
        out: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.Tensor]] = {}

        def add(prefix: str, suffix: str, flat: torch.Tensor, slices: list[Slice]) -> None:
            for name, shape, start, stop, at in slices:
                key, cut = f"{prefix}{self.key(name)}{suffix}", self.cuts.get(name)
                for off, size, first in flat_boxes(shape, start, stop):
                    lo = at + first - start
                    chunk = flat[lo : lo + math.prod(size)].reshape(size).detach()
                    if cut is None:
                        out.setdefault((key, off), (shape, chunk.to("cpu", copy=True)))
                        continue
                    for full_off, a, n in cut.boxes(off, size):  # the box, split at the pieces' edges
                        piece = chunk.narrow(cut.dim, a, n).to("cpu", copy=True).contiguous()
                        out.setdefault((key, full_off), (cut.full, piece))

        for p, slices in self.params:
            add(MODEL, "", p.detach().reshape(-1), slices)
        for name, buf in self.buffers.items():
            out.setdefault((MODEL + name, (0,) * buf.dim()), (tuple(buf.shape), buf.detach().to("cpu", copy=True)))
        for opt, p, slices in self.optimizer_params():
            for key, value in opt.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dim() == 0:
                    for name, *_ in slices:
                        out.setdefault((f"{OPTIM}{self.key(name)}.{key}", ()), ((), value.detach().to("cpu", copy=True)))
                else:
                    add(OPTIM, f".{key}", value.detach().reshape(-1), slices)
        return out

    def load(self, path: str, rank: int) -> None:
        """Read what this rank holds from the checkpoint at ``path`` and put it in place."""
        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
        names = set(self.full) | self.sharded_names | set(self.buffers)
        wanted: dict[str, torch.Tensor] = {}
        for name in sorted(names):
            key = MODEL + self.key(name)
            md = metadata.get(key)
            target = self.full.get(name)
            if target is None:
                target = self.buffers.get(name)
            if md is None:
                if name in self.buffers:
                    continue  # a buffer the checkpoint does not keep: leave it as initialised
                raise ExecutionError(
                    f"rank {rank}: the checkpoint at {path} has no parameter {self.key(name)!r} (saved from another "
                    "model?)",
                    ranks=(rank,),
                )
            if not isinstance(md, TensorStorageMetadata):
                raise ExecutionError(f"rank {rank}: checkpoint entry {key!r} is not a tensor", ranks=(rank,))
            shape = self.cuts[name].full if name in self.cuts else None
            if shape is None and target is not None:
                shape = tuple(target.shape)
            if shape is not None and tuple(md.size) != shape:
                raise ExecutionError(
                    f"rank {rank}: parameter {name!r} has shape {shape} here, "
                    f"{tuple(md.size)} in the checkpoint at {path}",
                    ranks=(rank,),
                )
            wanted[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        covered = {self.key(name) for _, _, slices in self.optimizer_params() for name, *_ in slices}
        prefixes = tuple(f"{OPTIM}{name}." for name in covered)
        for key, md in metadata.items():
            if key.startswith(prefixes) and isinstance(md, TensorStorageMetadata):
                wanted[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            dcp.load(wanted, storage_reader=FileSystemReader(path), no_dist=True)
        with torch.no_grad():
            for name, p in self.full.items():
                p.copy_(self.local(name, wanted[MODEL + self.key(name)]))
            for name, buf in self.buffers.items():
                if MODEL + name in wanted:
                    buf.copy_(wanted[MODEL + name])
            for b in self.data_parallel.buckets.values():
                if b.params_sharded:
                    flat = b.layout.flatten([self.local(n, wanted[MODEL + self.key(n)]) for n in b.bucket.params])
                    b.shard.copy_(b.layout.shard(flat, b.replica))
        for opt, p, slices in self.optimizer_params():
            opt.state.pop(p, None)
            # A fused or capturable torch optimizer keeps its step count on the parameter's device.
            scalars_to = p.device if any(g.get("fused") or g.get("capturable") for g in opt.param_groups) else None
            state: dict[str, torch.Tensor] = {}
            for name, _, start, stop, at in slices:
                prefix = f"{OPTIM}{self.key(name)}."
                for key in [k for k in wanted if k.startswith(prefix) and "." not in k[len(prefix):]]:
                    value, what = wanted[key], key[len(prefix):]
                    if value.dim() == 0:
                        state.setdefault(what, value.clone().to(scalars_to) if scalars_to else value.clone())
                        continue
                    if what not in state:
                        state[what] = torch.zeros(p.numel(), dtype=value.dtype, device=p.device)
                    state[what][at : at + stop - start] = self.local(name, value).reshape(-1)[start:stop]
            if state:
                opt.state[p] = {k: v if v.dim() == 0 else v.view(p.shape) for k, v in state.items()}


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default planner over pre-cut chunks: each piece is one ``SHARD`` write item at
    its offsets in the full tensor (what DCP makes of a ``DTensor``/``ShardedTensor`` shard);
    objects are ``BYTE_IO`` items."""

    def __init__(self, pieces: Mapping[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.Tensor]],
                 objects: Mapping[str, Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = dict(pieces)
        self.objects = dict(objects)

    def set_up_planner(self, state_dict: Any = None, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(key, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=chunk.shape),
                    properties=TensorProperties.create_from_tensor(chunk),
                    size=torch.Size(size),
                ),
            )
            for (key, off), (size, chunk) in self.pieces.items()
        ]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        key = write_item.index.fqn
        if write_item.type is WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self.objects[key], buffer)
            return buffer
        return self.pieces[(key, tuple(write_item.index.offset))][1]


class SaveSide:
    """One rank's half of a save: its local plan, then its files."""

    def __init__(self, path: str, rank: int, pieces: Mapping, objects: Mapping[str, Any]) -> None:
        self.planner = PieceSavePlanner(pieces, objects)
        self.planner.set_up_planner(is_coordinator=rank == 0)
        self.writer = _writer(path, rank)

    def plan(self) -> SavePlan:
        return self.writer.prepare_local_plan(self.planner.create_local_plan())

    def write(self, plan: SavePlan) -> list[WriteResult]:
        future = self.writer.write_data(self.planner.finish_plan(plan), self.planner)
        future.wait()
        return future.value()


def _writer(path: str, rank: int) -> FileSystemWriter:
    writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True, overwrite=False)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    return writer


def plan_globally(path: str, local_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """The driver's step between the ranks' local plans and their writes: one plan per rank
    (replicated chunks kept once, file names assigned) and the checkpoint's metadata."""
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    plans, metadata = planner.create_global_plan(local_plans)
    return _writer(path, 0).prepare_global_plan(plans), metadata


def finish(path: str, metadata: Metadata, results: list[list[WriteResult]]) -> None:
    """Write ``.metadata`` once every rank's files are written: the DCP checkpoint is whole."""
    _writer(path, 0).finish(metadata, results)


def read_objects(path: str, keys: Iterable[str]) -> dict[str, Any]:
    """The driver's objects (``BYTE_IO`` entries) of the checkpoint at ``path``."""
    wanted: dict[str, Any] = {key: None for key in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(wanted, storage_reader=FileSystemReader(path), no_dist=True)
    return wanted


def read_model(path: str) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of the checkpoint at ``path`` by parameter name: a plain
    single-device ``state_dict``."""
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    wanted = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in metadata.items()
        if key.startswith(MODEL) and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(wanted, storage_reader=FileSystemReader(path), no_dist=True)
    return {key[len(MODEL):]: t for key, t in wanted.items()}

