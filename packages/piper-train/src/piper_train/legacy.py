"""Converting a checkpoint of the earlier format, once, reading it as data.

Piper wrote checkpoints as torch distributed checkpoints (format version 1) until it wrote
safetensors and JSON. That format is pickles: ``.metadata`` is one, and every item in a
``__<r>_0.distcp`` file is ``torch.save``'s (a tensor chunk, or an object such as the train
state). torch's own reader unpickles them as they come, so a crafted checkpoint could run any
code. Nothing in Piper reads the format on its own (``checkpoints.legacy_error`` says so);
``convert`` reads it without running anything from it:

- ``.metadata`` through ``_MetadataUnpickler``, which builds only DCP's metadata classes,
  ``torch.Size``, dtypes, layouts and paths (an allow-list, as ``torch.load(weights_only=True)``
  has one) and refuses any other global a file names;
- each item with ``torch.load(weights_only=True)`` from its byte range, in a file of the
  checkpoint's own directory;

and writes the same tensors and objects as a checkpoint of the current format
(``piper convert-checkpoint SRC --out ROOT``), which loads and exports as one written today.
The source is left as it was. A file that asks for anything else is a ``CheckpointError``
naming it (exit 2).
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from piper_ir import CheckpointError
from piper_runtime.checkpoint import SaveSide, assemble, finish, plan_globally
from piper_train.checkpoints import MANIFEST, is_legacy, write_atomically

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What unpickling a damaged or crafted file raises (a refused global: UnpicklingError).
_DAMAGE = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
           RuntimeError, RecursionError)
# Every global a Piper checkpoint's .metadata names (traced), and nothing that runs code.
_ALLOWED: dict[tuple[str, str], Any] = {}


def _allowed(module: str, name: str) -> Any:
    if not _ALLOWED:
        from torch.distributed.checkpoint import filesystem, metadata
        from torch.serialization import _get_layout

        for cls in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                    "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"):
            _ALLOWED[(_DCP_METADATA, cls)] = getattr(metadata, cls)
        _ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
        _ALLOWED[("torch", "Size")] = torch.Size
        _ALLOWED[("torch.serialization", "_get_layout")] = _get_layout  # a layout by its name
        for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            _ALLOWED[("pathlib", cls)] = getattr(pathlib, cls)
    found = _ALLOWED.get((module, name))
    if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        found = getattr(torch, name)
    return found


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else (module doc)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never holds")
        return found


def convert(source: str | os.PathLike[str], out_root: str | os.PathLike[str]) -> Path:
    """Read the earlier-format checkpoint ``source`` as data (module doc) and write it to
    ``out_root/<its name>`` in the current format."""
    source, out_root = Path(source), Path(out_root)
    if not is_legacy(source):
        raise CheckpointError(f"{source} is not a checkpoint of the earlier format (no .metadata)")
    try:
        manifest = json.loads((source / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(f"{source / MANIFEST}: not a readable checkpoint manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("version") != 1:
        raise CheckpointError(f"{source / MANIFEST}: not a manifest of format version 1")
    tensors, objects = _read_dcp(source)
    pieces = {(key, (0,) * t.dim()): (tuple(t.shape), t) for key, t in tensors.items()}
    manifest = {k: v for k, v in manifest.items() if k not in ("format", "version")}

    def write(tmp: Path) -> None:
        side = SaveSide(str(tmp), 0, pieces, objects)
        assigned, index = plan_globally(str(tmp), [side.plan()])
        finish(str(tmp), index, [side.write(assigned[0])])

    try:
        return write_atomically(out_root / source.name, write, manifest)
    except TypeError as err:  # an object holding something the current format does not keep
        raise CheckpointError(f"{source}: {err}") from None


def _read_dcp(source: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor (assembled from its chunks) and object of the DCP checkpoint ``source``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = _read_metadata(source / ".metadata")
    try:
        entries, storage = dict(metadata.state_dict_metadata), dict(metadata.storage_data)
    except (AttributeError, TypeError):
        raise CheckpointError(f"{source / '.metadata'}: not a torch distributed checkpoint's metadata") from None
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    for key, md in entries.items():
        items = [(index, info) for index, info in storage.items() if getattr(index, "fqn", None) == key]
        if isinstance(md, BytesStorageMetadata) and len(items) == 1:
            objects[key] = _item(source, items[0][1])
        elif isinstance(md, TensorStorageMetadata):
            tensors[key] = _assemble(source, key, md, items)
        else:
            raise CheckpointError(f"{source / '.metadata'}: entry {key!r} is neither a tensor nor one object")
    return tensors, objects


def _read_metadata(file: Path) -> Any:
    try:
        with open(file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except OSError as err:
        raise CheckpointError(f"{file}: cannot read it ({err.strerror or err})") from None
    except _DAMAGE as err:  # any damage, and every refused global, is the file's
        raise CheckpointError(f"{file}: not a torch distributed checkpoint's metadata ({err})") from None


def _assemble(source: Path, key: str, md: Any, items: list[tuple[Any, Any]]) -> torch.Tensor:
    """Tensor ``key`` from its chunks (``checkpoint_files.assemble``: every element covered)."""
    shape = tuple(md.size)

    def chunks() -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
        for index, info in items:
            chunk = _item(source, info)
            if not isinstance(chunk, torch.Tensor):
                raise CheckpointError(f"{source / info.relative_path}: a chunk of {key} is not a tensor")
            offsets = tuple(index.offset) if index.offset is not None else (0,) * len(shape)
            yield offsets, chunk.to(md.properties.dtype)

    return assemble(shape, md.properties.dtype, chunks(), f"{source / '.metadata'}: {key}")


def _item(source: Path, info: Any) -> Any:
    """One item, ``torch.load(weights_only=True)`` of its bytes: tensors and plain containers."""
    name = getattr(info, "relative_path", None)
    if not isinstance(name, str) or name != os.path.basename(name) or name in ("", ".", ".."):
        raise CheckpointError(f"{source / '.metadata'}: names a file outside the checkpoint ({name!r})")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{source / name}: stored with transforms {info.transform_descriptors}, which this "
                              "conversion does not read")
    try:
        with open(source / name, "rb") as f:
            f.seek(int(info.offset))
            blob = f.read(int(info.length))
        return torch.load(io.BytesIO(blob), weights_only=True)
    except OSError as err:
        raise CheckpointError(f"{source / name}: cannot read it ({err.strerror or err})") from None
    except _DAMAGE as err:  # torch.load refuses what is not data: the file's damage
        raise CheckpointError(f"{source / name}: an item is not plain data ({_reason(err)})") from None


def _reason(err: BaseException) -> str:
    """Why an item was refused, in a line: the global it asked for (torch's own message goes on
    to suggest ``weights_only=False``, which is what this module exists not to do)."""
    lines = str(err).splitlines()
    named = [line.strip() for line in lines if "unsupported global" in line.lower()]
    if named:
        return named[0]
    return lines[0] if lines else type(err).__name__
