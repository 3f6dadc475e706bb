"""Sharded checkpoints of data only (safetensors and JSON, ``piper_runtime.checkpoint_files``):
each rank writes what it holds and reads what it needs, by the single-device parameter names
(docs/checkpoints.md). Nothing a checkpoint holds is unpickled on loading.

Keys (strategy-independent, so a checkpoint loads under any other strategy or on one device):

- ``model.<name>``: parameter (or buffer) ``<name>`` of the single-device model, its full shape;
- ``optim.<name>.<state>``: the optimizer state ``<state>`` (``exp_avg``, ``momentum_buffer``,
  ...) of that parameter, the parameter's shape; a scalar state (Adam's ``step``) is 0-d;
- objects (the training loop's state, each rank's generators): JSON trees whose tensors lie in
  the writing rank's file (``checkpoint_files.encode``); anything else is refused on saving.

A rank holds whole parameters (and their optimizer state), or, in a bucket whose optimizer
state or parameters live sharded (ZeRO), a flat range of the bucket's buffer: pieces of
several parameters, each a contiguous range of a parameter's row-major elements. The files
hold rectangular chunks, so a range is written as the few boxes that tile it
(``flat_boxes``). Replicas hold equal boxes under equal keys; the driver keeps one of each.

Saving has three steps with Ray between them (no process group needed: the ranks' gloo
groups carry the program's traffic): each rank copies what it holds and says which chunks
it has (``SaveSide.plan``), the driver assigns each chunk to one rank that has it, evening
out the bytes, and makes the index (``plan_globally``), each rank writes its file
(``SaveSide.write``), and the driver writes ``index.json`` (``finish``). Loading is each rank
on its own: it reads the full tensors of the parameters it holds (and their optimizer state)
and keeps its part, so any layout reshards.

A parameter that tensor or expert parallelism cuts across ranks (``Sharding.params``) is held
as pieces of one dimension, concatenated (``ParamShard.pieces``; ``Cut``): a rank writes each
of its boxes split at the pieces' edges, at their offsets in the full tensor, and on loading
cuts its pieces out of the full tensor it read. So such a checkpoint too holds single-device
tensors, and loads under any strategy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from piper_ir import CheckpointError, ExecutionError, Program
from piper_runtime.checkpoint_files import (
    BY_NAME,
    INDEX,
    Chunk,
    Index,
    ObjectEntry,
    Reader,
    TensorEntry,
    assemble,
    chunk_name,
    dtype_name,
    encode,
    rank_file,
    write_safetensors,
)

# The checkpoint format's API, a public submodule of piper-runtime (its names read as
# ``checkpoint.check``, ``checkpoint.finish``): the front door reads, checks and (converting
# the earlier format) writes checkpoints through these, the file layer's ``INDEX`` and
# ``assemble`` included, and nothing else of the package's checkpoint code.
__all__ = [
    "INDEX", "MODEL", "OPTIM", "Cut", "Index", "LocalPlan", "RankState", "SaveSide", "assemble", "check", "cuts_of",
    "finish", "flat_boxes", "plan_globally", "read_model", "read_objects",
]

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
            degree = sh.degree_of(spec)
            full[spec.dim] *= degree
            pieces = spec.pieces(full[spec.dim], degree, sh.position(rank, degree))
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
        with Reader(path) as reader:
            self._load(reader, path, rank)

    def _load(self, reader: Reader, path: str, rank: int) -> None:
        metadata = reader.index.tensors
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
            shape = self.cuts[name].full if name in self.cuts else None
            if shape is None and target is not None:
                shape = tuple(target.shape)
            if shape is not None and tuple(md.shape) != shape:
                raise ExecutionError(
                    f"rank {rank}: parameter {name!r} has shape {shape} here, "
                    f"{tuple(md.shape)} in the checkpoint at {path}",
                    ranks=(rank,),
                )
            wanted[key] = reader.tensor(key)
        covered = {self.key(name) for _, _, slices in self.optimizer_params() for name, *_ in slices}
        prefixes = tuple(f"{OPTIM}{name}." for name in covered)
        for key in metadata:
            if key.startswith(prefixes):
                wanted[key] = reader.tensor(key)
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


@dataclass(frozen=True)
class LocalPlan:
    """What one rank has to write: its chunks, ``(key, offsets) -> (sizes, full shape, dtype
    name)``, and its objects as JSON trees (their tensors in its file)."""

    chunks: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...], str]]
    objects: dict[str, Any] = field(default_factory=dict)


class SaveSide:
    """One rank's half of a save: what it holds, copied (``pieces``: ``(key, offsets) ->
    (full shape, chunk)``, ``RankState.pieces``) with its ``objects``; its local plan, then
    its file."""

    def __init__(self, path: str, rank: int, pieces: Mapping[tuple[str, tuple[int, ...]],
                 tuple[tuple[int, ...], torch.Tensor]], objects: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.rank = rank
        self.pieces = dict(pieces)
        self.trees: dict[str, Any] = {}
        self.object_tensors: dict[str, torch.Tensor] = {}
        for key, value in objects.items():
            tree, tensors = encode(value, f"object/{key}/")
            self.trees[key] = tree
            self.object_tensors.update(tensors)

    def plan(self) -> LocalPlan:
        chunks = {
            (key, tuple(off)): (tuple(chunk.shape), tuple(size), dtype_name(chunk.dtype))
            for (key, off), (size, chunk) in self.pieces.items()
        }
        return LocalPlan(chunks, self.trees)

    def write(self, assigned: Iterable[tuple[str, tuple[int, ...]]]) -> int:
        """Write the chunks the driver ``assigned`` to this rank, and its objects' tensors, to
        its file; the bytes written (0: no file, nothing was assigned)."""
        tensors = {chunk_name(key, off): self.pieces[(key, off)][1] for key, off in assigned}
        tensors.update(self.object_tensors)
        if not tensors:
            return 0
        return write_safetensors(self.path / rank_file(self.rank), tensors)


def plan_globally(path: str, local_plans: list[LocalPlan]) -> tuple[list[list[tuple[str, tuple[int, ...]]]], Index]:
    """The driver's step between the ranks' local plans and their writes: which chunks each
    rank writes (every chunk once, by a rank that holds it, the ranks' bytes evened out) and
    the checkpoint's index."""
    del path  # the index names files relative to the checkpoint's own directory
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    info: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...], str]] = {}
    for rank, plan in enumerate(local_plans):
        for chunk, what in plan.chunks.items():
            if info.setdefault(chunk, what) != what:
                raise CheckpointError(f"ranks disagree on checkpoint chunk {chunk_name(*chunk)}: {info[chunk]} and "
                                      f"{what} (rank {rank})")
            holders.setdefault(chunk, []).append(rank)
    load = [0] * len(local_plans)
    assigned: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in local_plans]
    tensors: dict[str, list[Chunk]] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for chunk in sorted(holders):  # a fixed order: the same plans give the same files
        sizes, shape, dtype = info[chunk]
        key, off = chunk
        if shapes.setdefault(key, (shape, dtype)) != (shape, dtype):
            raise CheckpointError(f"checkpoint key {key} has two shapes or dtypes: {shapes[key]} and {(shape, dtype)}")
        rank = min(holders[chunk], key=lambda r: (load[r], r))
        load[rank] += math.prod(sizes) * BY_NAME[dtype].itemsize
        assigned[rank].append(chunk)
        tensors.setdefault(key, []).append(Chunk(off, sizes, rank_file(rank), chunk_name(key, off)))
    objects = {key: ObjectEntry(rank_file(rank) if _has_tensors(tree) else None, tree)
               for rank, plan in enumerate(local_plans) for key, tree in plan.objects.items()}
    index = Index({key: TensorEntry(BY_NAME[shapes[key][1]], shapes[key][0], tuple(chunks))
                   for key, chunks in tensors.items()}, objects)
    return assigned, index


def _has_tensors(tree: Any) -> bool:
    if isinstance(tree, dict):
        return "tensor" in tree or any(_has_tensors(v) for v in tree.values())
    if isinstance(tree, list):
        return any(_has_tensors(v) for v in tree)
    return False


def finish(path: str, index: Index, results: list[int]) -> None:
    """Write ``index.json`` once every rank's file is written: the checkpoint's data is whole."""
    del results  # each rank's byte count: its write returned, so its file is on disk
    index.write(Path(path))


def check(path: str | Path) -> Index:
    """The index of the checkpoint at ``path``, checked against its files (headers only):
    ``CheckpointError`` naming a damaged or missing file before any rank reads one."""
    with Reader(path) as reader:
        reader.check()
        return reader.index


def read_objects(path: str, keys: Iterable[str]) -> dict[str, Any]:
    """The objects ``keys`` of the checkpoint at ``path`` (the driver's, or a rank's)."""
    with Reader(path) as reader:
        return {key: reader.object(key) for key in keys}


def read_model(path: str) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of the checkpoint at ``path`` by parameter name: a plain
    single-device ``state_dict``."""
    with Reader(path) as reader:
        return {key[len(MODEL):]: reader.tensor(key) for key in reader.keys() if key.startswith(MODEL)}
