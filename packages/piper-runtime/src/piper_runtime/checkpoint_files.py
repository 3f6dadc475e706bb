"""A checkpoint's files, which are data and never programs: tensors in safetensors files,
everything else in JSON. Nothing here unpickles or imports anything named by a file.

A checkpoint directory holds (``piper_runtime.checkpoint`` writes it, docs/checkpoints.md):

- ``rank-<r>.safetensors``: the chunks rank ``r`` wrote (rectangular boxes of single-device
  tensors, each under ``<key>@<offsets>``), and the tensors of the objects it wrote;
- ``index.json`` (``INDEX``): for each key its dtype, full shape and chunks (offsets, sizes,
  file, name in the file), and each object as a JSON tree (``encode``) whose tensors lie in a
  safetensors file.

Reading checks what it reads: the index's structure, each file's header (the safetensors
library refuses a file cut short or padded), that each chunk is in its file with the dtype
and shape the index says, and that a tensor's chunks lie inside it and cover it. A damaged
file is a ``CheckpointError`` naming it, never a traceback and never a partial tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import attrs
import torch

from piper_ir import CheckpointError

INDEX = "index.json"
INDEX_FORMAT = "piper-checkpoint-index"
INDEX_VERSION = 1
FILE_METADATA = {"format": "piper-checkpoint-shard"}
# Objects nest a few levels (a scheduler's state_dict in the train state); far deeper is damage.
MAX_DEPTH = 32

# torch dtype <-> safetensors' dtype name (its header's "dtype").
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
BY_NAME = {name: dtype for dtype, name in DTYPES.items()}


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def chunk_name(key: str, offsets: Iterable[int]) -> str:
    return f"{key}@{','.join(map(str, offsets))}"


def dtype_name(dtype: torch.dtype) -> str:
    name = DTYPES.get(dtype)
    if name is None:
        raise CheckpointError(f"a checkpoint cannot hold tensors of dtype {dtype}")
    return name


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> int:
    """Write ``tensors`` (CPU) to ``path`` in the safetensors format, streamed (no second copy
    of the data in memory) and fsynced; the bytes written. An ``OSError`` (a full disk) comes
    out as itself, so the caller can say what failed."""
    header: dict[str, Any] = {"__metadata__": FILE_METADATA}
    at = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the format's own writer does
    with open(path, "xb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(text) + at


# -- objects: JSON trees, tensors beside them -----------------------------------------------


def encode(
    value: Any, prefix: str, records: Mapping[str, type] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """``value`` (None, bool, int, finite or not float, str, list, tuple, dict, tensor, nested)
    as a JSON tree whose containers and tensors are tagged (``{"list": [...]}``,
    ``{"tensor": name}``, ...), and its tensors by name (``prefix``-ed, for a safetensors file).
    ``records``: attrs or dataclass types that may appear too, by name (``{"record": [name,
    fields]}``; a checkpoint allows none). Anything else is a ``TypeError`` naming where it
    sits: no object that only a program could rebuild."""
    tensors: dict[str, torch.Tensor] = {}
    names = {cls: name for name, cls in (records or {}).items()}

    def enc(v: Any, where: str) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return {"int": str(v)} if abs(v) >= 2**53 else v  # beyond what every JSON reader keeps exact
        if isinstance(v, float):
            return v if math.isfinite(v) else {"float": repr(v)}
        if isinstance(v, torch.Tensor):
            name = f"{prefix}{len(tensors)}"
            tensors[name] = v.detach().to("cpu", copy=True).contiguous()
            return {"tensor": name}
        if isinstance(v, (list, tuple)):
            return {type(v).__name__: [enc(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, dict):
            return {"dict": [[enc(k, f"{where} key"), enc(x, f"{where}[{k!r}]")] for k, x in v.items()]}
        if type(v) in names:
            return {"record": [names[type(v)], enc(_fields(v), f"{where}.")]}
        raise TypeError(f"a checkpoint object holds only data; {prefix.rstrip('/')}{where} is a {type(v).__name__}")

    return enc(value, ""), tensors


def decode(tree: Any, tensor: Any, where: str, records: Mapping[str, type] | None = None) -> Any:
    """The value ``encode`` made ``tree`` of; ``tensor(name)`` gives a tensor it names;
    ``records`` the record types it may build, by name (none unless given). ``CheckpointError``
    naming ``where`` for anything ``encode`` never writes."""

    def dec(t: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        if t is None or isinstance(t, (bool, int, float, str)):
            return t
        if isinstance(t, dict) and len(t) == 1:
            (tag, body), = t.items()
            if tag in ("list", "tuple") and isinstance(body, list):
                items = [dec(x, depth + 1) for x in body]
                return items if tag == "list" else tuple(items)
            if tag == "dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
                return {_hashable(dec(k, depth + 1), where): dec(v, depth + 1) for k, v in body}
            if tag == "tensor" and isinstance(body, str):
                return tensor(body)
            if tag == "float" and body in ("nan", "inf", "-inf"):
                return float(body)
            if tag == "int" and isinstance(body, str) and body.lstrip("-").isdigit() and len(body) < 400:
                return int(body)
            if tag == "record" and isinstance(body, list) and len(body) == 2 and body[0] in (records or {}):
                fields = dec(body[1], depth + 1)
                if isinstance(fields, dict) and all(isinstance(k, str) for k in fields):
                    try:
                        return records[body[0]](**fields)  # type: ignore[index]
                    except TypeError as err:
                        raise CheckpointError(f"{where}: a {body[0]} record does not fit: {err}") from None
        raise CheckpointError(f"{where}: not a value a Piper checkpoint writes ({_excerpt(t)})")

    return dec(tree, 0)


def _fields(record: Any) -> dict[str, Any]:
    """An attrs or dataclass instance's fields by name (what its constructor takes back)."""
    if attrs.has(type(record)):
        return {f.name: getattr(record, f.name) for f in attrs.fields(type(record))}
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


def _hashable(key: Any, where: str) -> Any:
    try:
        hash(key)
    except TypeError:
        raise CheckpointError(f"{where}: a dictionary key is a {type(key).__name__}") from None
    return key


def _excerpt(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- the index -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """A box of a tensor: at ``offsets`` in the full tensor, of ``sizes``, stored in ``file``
    under ``name``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    name: str


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class ObjectEntry:
    """An object: its JSON tree (``encode``), its tensors in ``file``."""

    file: str | None
    value: Any


@dataclass(frozen=True)
class Index:
    """What ``INDEX`` says: where every tensor's chunks lie, and the objects."""

    tensors: Mapping[str, TensorEntry]
    objects: Mapping[str, ObjectEntry]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "tensors": {
                key: {"dtype": DTYPES[e.dtype], "shape": list(e.shape),
                      "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file, "name": c.name}
                                 for c in e.chunks]}
                for key, e in self.tensors.items()
            },
            "objects": {key: {"file": o.file, "value": o.value} for key, o in self.objects.items()},
        }

    def write(self, directory: Path) -> None:
        with open(directory / INDEX, "x") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> Index:
        """The index of the checkpoint in ``directory``, checked for structure (not yet
        against the files: ``Reader.check``); ``CheckpointError`` naming the file."""
        file = Path(directory) / INDEX
        try:
            raw = json.loads(file.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing (a partial or damaged checkpoint)") from None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
            raise CheckpointError(f"{file}: not a readable checkpoint index ({_reason(err)})") from None
        try:
            return cls._from_json(raw)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{file}: not a valid checkpoint index ({_reason(err)})") from None

    @classmethod
    def _from_json(cls, raw: Any) -> Index:
        if not isinstance(raw, dict) or raw.get("format") != INDEX_FORMAT:
            raise ValueError("no index format name")
        if raw.get("version") != INDEX_VERSION:
            raise ValueError(f"index version {raw.get('version')!r}, this Piper reads {INDEX_VERSION}")
        tensors = {}
        for key, e in _mapping(raw["tensors"]).items():
            dtype = BY_NAME[e["dtype"]] if e["dtype"] in BY_NAME else None
            if dtype is None:
                raise ValueError(f"{key}: dtype {e['dtype']!r}")
            shape = _ints(e["shape"], f"{key}: shape")
            chunks = tuple(
                Chunk(_ints(c["offsets"], f"{key}: offsets"), _ints(c["sizes"], f"{key}: sizes"),
                      _file_name(c["file"]), _str(c["name"]))
                for c in _list(e["chunks"])
            )
            tensors[_str(key)] = TensorEntry(dtype, shape, chunks)
        objects = {
            _str(key): ObjectEntry(None if o["file"] is None else _file_name(o["file"]), o["value"])
            for key, o in _mapping(raw["objects"]).items()
        }
        return cls(tensors, objects)

    def files(self) -> set[str]:
        names = {c.file for e in self.tensors.values() for c in e.chunks}
        return names | {o.file for o in self.objects.values() if o.file is not None}


def _mapping(v: Any) -> dict:
    if not isinstance(v, dict):
        raise TypeError(f"expected an object, found {type(v).__name__}")
    return v


def _list(v: Any) -> list:
    if not isinstance(v, list):
        raise TypeError(f"expected a list, found {type(v).__name__}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, found {type(v).__name__}")
    return v


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
        raise ValueError(f"{what} is not a list of sizes")
    return tuple(v)


def _file_name(v: Any) -> str:
    """A file of the checkpoint's own directory: a plain name, never a path elsewhere."""
    name = _str(v)
    if not name or name != os.path.basename(name) or name in (".", "..") or not name.endswith(".safetensors"):
        raise ValueError(f"file {name!r} is not a safetensors file of the checkpoint's directory")
    return name


def _reason(err: BaseException) -> str:
    if isinstance(err, RecursionError):
        return "nested too deeply"
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def assemble(shape: tuple[int, ...], dtype: torch.dtype, chunks: Iterable[tuple[tuple[int, ...], torch.Tensor]],
             where: str) -> torch.Tensor:
    """The tensor of ``shape`` whose boxes are ``chunks`` (offsets, tensor); ``CheckpointError``
    naming ``where`` when a chunk lies outside it or the chunks leave part of it unwritten
    (chunks that overlap leave a hole elsewhere)."""
    out = torch.empty(shape, dtype=dtype)
    seen = torch.zeros(shape, dtype=torch.bool)
    for offsets, chunk in chunks:
        if len(offsets) != len(shape) or chunk.dim() != len(shape) or any(
                o + n > size for o, n, size in zip(offsets, chunk.shape, shape, strict=True)):
            raise CheckpointError(f"{where}: a chunk at {list(offsets)} of {list(chunk.shape)} lies outside its "
                                  f"shape {list(shape)}")
        box = tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape, strict=True))
        out[box] = chunk
        seen[box] = True
    if not bool(seen.all()):
        raise CheckpointError(f"{where}: its chunks leave part of it unwritten (they overlap, or one is missing)")
    return out


# -- reading ---------------------------------------------------------------------------------


class Reader:
    """Reads tensors and objects of the checkpoint in ``directory`` by its index, each file
    opened once (``close`` or ``with``)."""

    def __init__(self, directory: str | os.PathLike[str], index: Index | None = None) -> None:
        self.directory = Path(directory)
        self.index = index if index is not None else Index.read(self.directory)
        self._open: dict[str, Any] = {}

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def _file(self, name: str) -> Any:
        handle = self._open.get(name)
        if handle is None:
            from safetensors import SafetensorError, safe_open

            path = self.directory / name
            try:
                handle = safe_open(str(path), framework="pt").__enter__()
            except FileNotFoundError:
                raise CheckpointError(f"{path} is missing (a partial or damaged checkpoint)") from None
            except (OSError, SafetensorError) as err:
                raise CheckpointError(f"{path}: not a readable safetensors file ({_reason(err)})") from None
            if handle.metadata() != FILE_METADATA:
                handle.__exit__(None, None, None)
                raise CheckpointError(f"{path}: not a Piper checkpoint file")
            self._open[name] = handle
        return handle

    def _tensor(self, file: str, name: str, dtype: torch.dtype | None, shape: tuple[int, ...] | None) -> torch.Tensor:
        return self._header(file, name, dtype, shape).get_tensor(name)

    def _header(self, file: str, name: str, dtype: torch.dtype | None, shape: tuple[int, ...] | None) -> Any:
        """The open ``file``, once tensor ``name`` is there with ``dtype`` and ``shape`` (where
        given) in its header."""
        handle = self._file(file)
        where = self.directory / file
        if name not in handle.keys():
            raise CheckpointError(f"{where} has no tensor {name!r} (damaged, or from another checkpoint)")
        if dtype is not None or shape is not None:
            info = handle.get_slice(name)
            if (dtype is not None and info.get_dtype() != DTYPES[dtype]) or (
                    shape is not None and tuple(info.get_shape()) != shape):
                raise CheckpointError(f"{where}: tensor {name!r} is {info.get_dtype()} {info.get_shape()}, the index "
                                      f"says {DTYPES.get(dtype, dtype)} {list(shape or ())}")
        return handle

    def check(self) -> None:
        """Every file the index names opens as a Piper safetensors file holding each chunk
        with the index's dtype and shape, and every tensor's chunks tile it (each inside it,
        their elements adding up to it). Reads headers only."""
        for key, entry in self.index.tensors.items():
            self._check_tiling(key, entry)
            for c in entry.chunks:
                self._header(c.file, c.name, entry.dtype, c.sizes)
        for key, o in self.index.objects.items():
            if o.file is not None:
                self._file(o.file)
            decode(o.value, lambda name: None, f"{self.directory / INDEX}: object {key!r}")

    def _check_tiling(self, key: str, entry: TensorEntry) -> None:
        where = f"{self.directory / INDEX}: {key}"
        total = 0
        for c in entry.chunks:
            if len(c.offsets) != len(entry.shape) or len(c.sizes) != len(entry.shape) or any(
                    o + s > n for o, s, n in zip(c.offsets, c.sizes, entry.shape, strict=True)):
                raise CheckpointError(f"{where}: a chunk at {list(c.offsets)} of {list(c.sizes)} lies outside its "
                                      f"shape {list(entry.shape)}")
            total += math.prod(c.sizes)
        if total != math.prod(entry.shape):
            raise CheckpointError(f"{where}: its chunks hold {total} elements, its shape {math.prod(entry.shape)}")

    def tensor(self, key: str) -> torch.Tensor:
        """The full tensor ``key``, assembled from its chunks."""
        entry = self.index.tensors.get(key)
        if entry is None:
            raise CheckpointError(f"the checkpoint at {self.directory} has no tensor {key!r}")
        self._check_tiling(key, entry)
        chunks = ((c.offsets, self._tensor(c.file, c.name, entry.dtype, c.sizes)) for c in entry.chunks)
        return assemble(entry.shape, entry.dtype, chunks, f"{self.directory / INDEX}: {key}")

    def object(self, key: str) -> Any:
        """The object ``key``, its tensors read back in place."""
        entry = self.index.objects.get(key)
        if entry is None:
            raise CheckpointError(f"the checkpoint at {self.directory} has no object {key!r}")
        where = f"{self.directory / INDEX}: object {key!r}"

        def tensor(name: str) -> torch.Tensor:
            if entry.file is None:
                raise CheckpointError(f"{where} names tensor {name!r} but no file")
            return self._tensor(entry.file, name, None, None)

        return decode(entry.value, tensor, where)

    def keys(self) -> Iterator[str]:
        return iter(self.index.tensors)
