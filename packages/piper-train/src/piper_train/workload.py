"""Where a model comes from: a built-in example or a user's ``path/to/file.py:factory``.

The factory contract (also in the README): ``factory()`` takes no arguments and returns
``(model, example_inputs, example_targets, loss_fn)`` where ``model`` is an ``nn.Module``
whose ``forward`` is fully covered by ``annotate("PP")`` regions, the inputs and targets are
a tensor or a tuple of tensors holding one full batch (dim 0 is the batch), and
``loss_fn(*outputs, *targets)`` returns a scalar mean loss. Every training step reuses that
batch. The strategy decides how many regions go on each rank, so one factory serves every
strategy (the region count must be divisible by the number of pipeline ranks).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from piper_train.models import MODELS, ModelSpec, build_model


def _as_tuple(value: object, what: str, origin: str) -> tuple[torch.Tensor, ...]:
    items = value if isinstance(value, tuple | list) else (value,)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise ValueError(f"{origin}: {what} must be a tensor or a tuple of tensors")
    return tuple(items)


def load_factory(spec: str) -> ModelSpec:
    """Import ``path.py:factory`` and call it."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not path_text or not name or not path.is_file():
        raise ValueError(f"model {spec!r}: expected an existing 'path/to/file.py:factory'")
    module_name = f"piper_user_{path.stem}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise ValueError(f"model {spec!r}: cannot import {path}")
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    loader.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"model {spec!r}: {path} has no callable {name!r}")
    result = factory()
    if not isinstance(result, tuple) or len(result) != 4:
        raise ValueError(f"model {spec!r}: the factory must return (model, inputs, targets, loss_fn)")
    model, inputs, targets, loss_fn = result
    if not isinstance(model, torch.nn.Module) or not callable(loss_fn):
        raise ValueError(f"model {spec!r}: the factory must return (nn.Module, inputs, targets, callable loss)")
    inputs_t, targets_t = _as_tuple(inputs, "inputs", spec), _as_tuple(targets, "targets", spec)
    return ModelSpec(spec, model, inputs_t, targets_t, loss_fn, lambda step: (inputs_t, targets_t), 0, 0)


def load_workload(spec: str, *, stages: int, seed: int = 0) -> ModelSpec:
    """A built-in model name (``mlp``, ``transformer``, ``lm``) or ``file.py:factory``."""
    if spec in MODELS:
        return build_model(spec, stages=stages, seed=seed)
    if ":" in spec:
        return load_factory(spec)
    raise ValueError(f"unknown model {spec!r}; use one of {sorted(MODELS)} or 'path/to/file.py:factory'")
