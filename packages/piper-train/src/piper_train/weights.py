"""Initial weights from safetensors files: ``piper train --init-from PATH``.

``PATH`` is a ``.safetensors`` file, or a folder holding ``model.safetensors`` or a sharded
set with its index (``model.safetensors.index.json``, as ``save_pretrained`` writes them), or
any single ``*.safetensors`` file. Tensors are matched to the model by name
(``model.state_dict()``'s names, as Hugging Face and ``piper export`` write them) and copied
in; safetensors is data, so nothing in the folder runs. Each tensor is read alone
(``safe_open``), never a whole file into memory at once.

Strict, naming the culprits: a parameter or persistent buffer no file holds (a tied parameter
is covered by any of its names: Hugging Face omits ``lm_head.weight`` when it is tied), a
tensor of another shape, and a tensor the model has no name for. The driver reads the
weights before capture; the ranks receive their pieces from it as they receive any model's
initial weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch
from torch import nn

INDEX = "model.safetensors.index.json"


@attrs.frozen
class LoadedWeights:
    """What ``load_weights`` read: how many tensors from how many files."""

    tensors: int
    files: int


def weight_files(path: Path) -> dict[str, Path]:
    """Each tensor name in ``path``'s safetensors -> the file holding it (module doc)."""
    from safetensors import safe_open

    if path.is_file():
        files = [path]
    elif (path / INDEX).is_file():
        try:
            index = json.loads((path / INDEX).read_text(encoding="utf-8"))
            return {name: path / file for name, file in index["weight_map"].items()}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"--init-from {path}: {INDEX} is not a safetensors index: {err}") from None
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if len(files) != 1:
            raise ValueError(f"--init-from {path}: expected a .safetensors file, or a folder with model.safetensors, "
                             f"{INDEX} or one *.safetensors file; found {len(files)} safetensors files")
    names: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names.update(dict.fromkeys(f.keys(), file))
        except Exception as err:  # safetensors' own errors: a truncated or foreign file
            raise ValueError(f"--init-from {file}: not a safetensors file: {err}") from None
    return names


def load_weights(model: nn.Module, path: Path) -> LoadedWeights:
    """Copy the tensors of ``path`` into ``model`` by name (module doc)."""
    from safetensors import safe_open

    if not path.exists():
        raise ValueError(f"--init-from {path}: no such file or folder")
    located = weight_files(path)
    state = model.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for name, tensor in state.items():
        aliases.setdefault(id(tensor), []).append(name)
    unexpected = sorted(set(located) - set(state))
    if unexpected:
        raise ValueError(f"--init-from {path}: {len(unexpected)} tensor(s) the model has no name for: "
                         f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    missing = [names[0] for names in aliases.values() if not any(n in located for n in names)]
    if missing:
        raise ValueError(f"--init-from {path}: no tensor for {len(missing)} of the model's weights: "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    opened = set()
    with torch.no_grad():
        for file in sorted(set(located.values())):
            opened.add(file)
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as err:  # a file the index names that is missing, truncated or foreign
                raise ValueError(f"--init-from {file}: cannot read it as safetensors: {err}") from None
            with handle as f:
                for name in f.keys():
                    target = state[name]
                    value = f.get_tensor(name)
                    if tuple(value.shape) != tuple(target.shape):
                        raise ValueError(f"--init-from {file}: {name} has shape {tuple(value.shape)}, the model's "
                                         f"{tuple(target.shape)}")
                    target.copy_(value.to(target.dtype))
    return LoadedWeights(len(located), len(opened))
