"""Tags, phases and filters: how directives select nodes.

A node's tags map annotation names to indices (``{"PP": 1, "EP": 3}``). Two further keys are
always available to filters: ``PASS`` (the node's phase: F, B, BI, BW, OPT) and ``MB`` (its
microbatch). ``"*"`` in a filter matches any value that is present.
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

FilterValue = int | str


class Phase(StrEnum):
    """Which pass of the training step a compute node belongs to."""

    F = "F"  # forward
    B = "B"  # full backward (inputs and weights)
    BI = "BI"  # backward to inputs only
    BW = "BW"  # backward to weights only
    OPT = "OPT"  # optimizer update


def _freeze_items(value: Mapping[str, FilterValue] | tuple) -> tuple[tuple[str, FilterValue], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    out = []
    for key, val in items:
        if not isinstance(key, str) or not key:
            raise TypeError(f"tag names must be non-empty strings, got {key!r}")
        if isinstance(val, bool) or not isinstance(val, int | str):
            raise TypeError(f"tag {key!r} has value {val!r}; expected an int or a string")
        out.append((key, val))
    return tuple(sorted(out))


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
    """Selects nodes by tags, ``PASS``, ``MB`` and ``SEG`` (segment id); ``"*"`` is a wildcard.

    An empty filter matches every compute node. Build one with ``Filter.of({"PP": 1})`` or
    ``Filter.of(PP=1, PASS="F")``.
    """

    items: tuple[tuple[str, FilterValue], ...] = attrs.field(default=(), converter=_freeze_items)

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
            if want != ANY and want != have:
                return False
        return True

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k}: {v!r}" for k, v in self.items) + "}"
