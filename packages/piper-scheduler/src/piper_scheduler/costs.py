"""The cost model the simulator charges instructions with (abstract time units)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from piper_ir import Phase, TensorMeta

Overrides = tuple[tuple[str, Phase, float], ...]


def _overrides(value: Mapping[str, Mapping[str, float]] | Overrides) -> Overrides:
    if isinstance(value, Mapping):
        items = [(seg, Phase(ph), float(c)) for seg, costs in value.items() for ph, c in costs.items()]
    else:
        items = [(seg, Phase(ph), float(c)) for seg, ph, c in value]
    return tuple(sorted(items))


@attrs.frozen
class CostModel:
    """Per-phase compute costs, per-segment overrides and a latency/bandwidth link model.

    ``overrides`` maps segment id -> phase -> cost (``{"loss": {"F": 0, "B": 0}}``); it is
    stored as sorted ``(segment, phase, cost)`` triples so the model stays hashable. A transfer
    of ``n`` bytes costs ``latency + n / bandwidth``; by default communication is free.
    """

    F: float = 1.0
    B: float = 2.0
    BI: float = 1.0
    BW: float = 1.0
    OPT: float = 0.0
    overrides: Overrides = attrs.field(default=(), converter=_overrides)
    latency: float = 0.0
    bandwidth: float = math.inf

    def compute_cost(self, segment: str | None, phase: Phase | None) -> float:
        """The duration of ``segment``'s ``phase`` (0 for an instruction without a phase)."""
        if phase is None:
            return 0.0
        for seg, ph, cost in self.overrides:
            if seg == segment and ph is phase:
                return cost
        return float(getattr(self, phase.value))

    def comm_cost(self, meta: TensorMeta | None) -> float:
        """The duration of one transfer (or collective) of a tensor described by ``meta``."""
        nbytes = meta.nbytes() if meta is not None else 0
        return self.latency + (nbytes / self.bandwidth if nbytes else 0.0)
