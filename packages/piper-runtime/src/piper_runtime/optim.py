"""Optimizer specification: a small, picklable value a worker turns into a torch optimizer."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def _freeze_kwargs(value: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), v) for k, v in items))


def _check_name(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    if value not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {value!r}; expected one of {sorted(_OPTIMIZERS)}")


@attrs.frozen
class OptimizerSpec:
    """Which optimizer each stage segment gets: ``name`` ("sgd", "adam", "adamw"), ``lr`` and
    further keyword arguments (``kwargs``, a mapping or pairs, stored as sorted pairs)."""

    name: str = attrs.field(default="sgd", validator=_check_name)
    lr: float = 0.01
    kwargs: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_freeze_kwargs)

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return _OPTIMIZERS[self.name](list(params), lr=self.lr, **dict(self.kwargs))
