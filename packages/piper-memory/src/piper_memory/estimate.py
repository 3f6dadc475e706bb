"""Per-rank memory estimates of a compiled ``Program`` (pure IR, no torch).

For each rank: bytes of the parameters of the segments it runs, of their gradients, of the
optimizer state, and the peak bytes of activations held between a forward and its backward.
Activations are counted at segment boundaries only (the ``Segment.outputs`` value metas of
each forward, already split per microbatch): the IR does not describe a segment's interior,
so the figure is a lower bound that is exact in its *shape* across schedules (GPipe holds M
microbatches, 1F1B at most the number of stages).
"""

from __future__ import annotations

import attrs

from piper_ir import NodeKind, Phase, Program, SegmentRole

# Optimizer state per parameter byte (Adam/AdamW keep two moments).
OPTIMIZER_STATE_FACTOR = {"sgd": 0, "adam": 2, "adamw": 2}


@attrs.frozen
class MemoryEstimate:
    rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    peak_activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_state_bytes + self.peak_activation_bytes


def estimate_memory(program: Program, optimizer: str = "adamw") -> dict[int, MemoryEstimate]:
    """Rank -> ``MemoryEstimate`` for ``program`` trained with ``optimizer``
    ("sgd", "adam" or "adamw")."""
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATE_FACTOR)}")
    factor = OPTIMIZER_STATE_FACTOR[optimizer]
    out: dict[int, MemoryEstimate] = {}
    for plan in program.ranks:
        segments = [program.segment_by_id[s] for s in plan.segments()]
        params = sum(meta.nbytes() for seg in segments for _, meta in seg.params)
        trained = sum(
            meta.nbytes() for seg in segments if seg.role is SegmentRole.STAGE for _, meta in seg.params
        )
        out[plan.rank] = MemoryEstimate(
            rank=plan.rank,
            param_bytes=params,
            grad_bytes=trained,
            optimizer_state_bytes=factor * trained,
            peak_activation_bytes=_peak_activations(program, plan.rank),
        )
    return out


def _peak_activations(program: Program, rank: int) -> int:
    """Max over the rank's sequential order of the bytes of forwards not yet backwarded."""
    live: dict[tuple[str, int | None], int] = {}
    current = peak = 0
    for ins in program.plan(rank).instructions:
        if ins.kind is not NodeKind.COMPUTE:
            continue
        key = (ins.segment, ins.microbatch)
        if ins.phase is Phase.F:
            seg = program.segment_by_id[ins.segment]
            size = sum(
                program.value_by_name[v].meta.nbytes() for v in seg.outputs if v in program.value_by_name
            )
            live[key] = live.get(key, 0) + size
            current += size
            peak = max(peak, current)
        elif ins.phase in (Phase.B, Phase.BW):  # BI keeps what BW still needs
            current -= live.pop(key, 0)
    return peak
