"""Converting a checkpoint of the earlier format, once, for a user who trusts it.

Piper wrote checkpoints as torch distributed checkpoints (format version 1) until it wrote
data only. Reading one unpickles its ``.metadata`` and its objects (``torch.load`` without
``weights_only``): a checkpoint from someone else can run any code. Nothing in Piper reads
that format on its own (``checkpoints.legacy_error`` says so); ``convert`` does, only when the
caller says it trusts the file (``piper convert-checkpoint SRC --out ROOT --trust-pickles``),
and writes the same tensors and objects as a checkpoint of the current format, which loads
and exports as one written today. The source is left as it was.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from piper_ir import CheckpointError
from piper_runtime.checkpoint import SaveSide, finish, plan_globally
from piper_train.checkpoints import MANIFEST, is_legacy, write_atomically


def convert(source: str | os.PathLike[str], out_root: str | os.PathLike[str], *, trust_pickles: bool) -> Path:
    """Read the earlier-format checkpoint ``source`` (unpickling it: only with
    ``trust_pickles``) and write it to ``out_root/<its name>`` in the current format."""
    source, out_root = Path(source), Path(out_root)
    if not trust_pickles:
        raise CheckpointError(f"converting {source} unpickles its files, which can run code: say that you trust it "
                              "(--trust-pickles)")
    if not is_legacy(source):
        raise CheckpointError(f"{source} is not a checkpoint of the earlier format (no .metadata)")
    try:
        manifest = json.loads((source / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
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

    return write_atomically(out_root / source.name, write, manifest)


def _read_dcp(source: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every tensor and object of the DCP checkpoint ``source`` (unpickles: the caller trusts it)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = FileSystemReader(str(source)).read_metadata().state_dict_metadata
    tensors = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
               for key, md in metadata.items() if isinstance(md, TensorStorageMetadata)}
    objects: dict[str, Any] = {key: None for key, md in metadata.items() if isinstance(md, BytesStorageMetadata)}
    state = {**tensors, **objects}  # tensors are filled in place, objects replaced in the dict
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, storage_reader=FileSystemReader(str(source)), no_dist=True)
    return {k: state[k] for k in tensors}, {k: state[k] for k in objects}
