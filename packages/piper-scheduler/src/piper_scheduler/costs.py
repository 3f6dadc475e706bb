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

    ``FB`` is the time of an overlapped forward + backward pair (DualPipe's F&B, between
    ``max(F, B)`` and ``F + B``): the compute of an overlapped slot (``Instruction.overlap``)
    is charged ``FB / (F + B)`` of its cost, so a pair whose halves cost F and B costs FB.
    ``None`` (the default) runs the two halves back to back at full cost.

    ``overhead`` is added to every compute instruction (the executor's dispatch cost), and
    ``comm_overhead`` to every SEND/RECV/collective (posting and completing a message);
    ``startup`` is when every stream may begin (a runtime's per-step set-up, such as
    splitting the batch into microbatches).
    """

    F: float = 1.0
    B: float = 2.0
    BI: float = 1.0
    BW: float = 1.0
    OPT: float = 0.0
    overrides: Overrides = attrs.field(default=(), converter=_overrides)
    latency: float = 0.0
    bandwidth: float = math.inf
    FB: float | None = None
    overhead: float = 0.0
    comm_overhead: float = 0.0
    startup: float = 0.0

    def overlap_factor(self) -> float:
        """What an instruction of an overlapped slot pays per unit of its own cost."""
        if self.FB is None or self.F + self.B <= 0:
            return 1.0
        return self.FB / (self.F + self.B)

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
