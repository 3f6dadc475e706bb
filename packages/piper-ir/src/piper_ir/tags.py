"""Tags, phases and filters: how directives select nodes.

A node's tags map annotation names to indices (``{"PP": 1, "EP": 3}``). Two further keys are
always available to filters: ``PASS`` (the node's phase: F, B, BI, BW, OPT) and ``MB`` (its
microbatch). ``"*"`` in a filter matches any value that is present; a tuple of values matches
any one of them (``{"MB": (0, 1, 2)}``: the first three microbatches).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from piper_ir.graph import Node

ANY = "*"
PASS = "PASS"
MB = "MB"
SEG = "SEG"

Scalar = int | str
FilterValue = Scalar | tuple[Scalar, ...]


class Phase(StrEnum):
    """Which pass of the training step a compute node belongs to."""

    F = "F"  # forward
    B = "B"  # full backward (inputs and weights)
    BI = "BI"  # backward to inputs only
    BW = "BW"  # backward to weights only
    OPT = "OPT"  # optimizer update


def _key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise TypeError(f"tag names must be non-empty strings, got {key!r}")
    return key


def _scalar(key: str, val: object) -> Scalar:
    if isinstance(val, bool) or not isinstance(val, int | str):
        raise TypeError(f"tag {key!r} has value {val!r}; expected an int or a string")
    return val


def _freeze_items(value: Mapping[str, Scalar] | tuple) -> tuple[tuple[str, Scalar], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((_key(k), _scalar(k, v)) for k, v in items))


def _filter_value(key: str, val: object) -> FilterValue:
    """A scalar, or a non-empty list/tuple of scalars without ``"*"`` (kept as a tuple)."""
    if not isinstance(val, list | tuple):
        return _scalar(key, val)
    members = tuple(_scalar(key, v) for v in val)
    if not members or ANY in members:
        raise TypeError(f"tag {key!r} has value {val!r}; a set of values is non-empty and has no {ANY!r}")
    return members


def _freeze_filter(value: Mapping[str, FilterValue] | tuple) -> tuple[tuple[str, FilterValue], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted(((_key(k), _filter_value(k, v)) for k, v in items), key=lambda kv: kv[0]))


@attrs.frozen
class Tags:
    """An immutable mapping from annotation name to index, e.g. ``{"PP": 1}``."""

    items: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_freeze_items)

    @classmethod
    def of(cls, mapping: Mapping[str, int] | None = None, **kwargs: int) -> Tags:
        merged = dict(mapping or {}, **kwargs)
        return cls(tuple(merged.items()))

    def get(self, name: str) -> int | None:
        for key, val in self.items:
            if key == name:
                return val  # type: ignore[return-value]
        return None

    def as_dict(self) -> dict[str, int]:
        return dict(self.items)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.items)


@attrs.frozen
class Filter:
    """Selects nodes by tags, ``PASS``, ``MB`` and ``SEG`` (segment id); ``"*"`` is a wildcard
    and a tuple of values matches any one of them.

    An empty filter matches every compute node. Build one with ``Filter.of({"PP": 1})``,
    ``Filter.of(PP=1, PASS="F")`` or ``Filter.of(PP=1, MB=(0, 1))``.
    """

    items: tuple[tuple[str, FilterValue], ...] = attrs.field(default=(), converter=_freeze_filter)

    @classmethod
    def of(cls, mapping: Mapping[str, FilterValue] | None = None, **kwargs: FilterValue) -> Filter:
        merged = dict(mapping or {}, **kwargs)
        return cls(tuple(merged.items()))

    def as_dict(self) -> dict[str, FilterValue]:
        return dict(self.items)

    def matches(self, node: Node) -> bool:
        for key, want in self.items:
            if key == PASS:
                have: FilterValue | None = node.phase.value if node.phase else None
            elif key == MB:
                have = node.microbatch
            elif key == SEG:
                have = node.segment
            else:
                have = node.tags.get(key)
            if have is None:
                return False
            if isinstance(want, tuple):
                if have not in want:
                    return False
            elif want != ANY and want != have:
                return False
        return True

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k}: {v!r}" for k, v in self.items) + "}"
