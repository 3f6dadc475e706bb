"""The result of a simulation: when every instruction ran, idle time and activation memory."""

from __future__ import annotations

import attrs

from piper_ir import NodeKind, Phase


@attrs.frozen
class Interval:
    """One instruction's execution on one rank's stream."""

    rank: int
    stream: str
    instruction: str  # the instruction id
    label: str  # ``Instruction.short()``
    start: float
    end: float
    kind: NodeKind = NodeKind.COMPUTE
    segment: str | None = None
    phase: Phase | None = None
    microbatch: int | None = None
    overlap: int | None = None  # ``Instruction.overlap``: one number per overlapped F&B slot

    @property
    def duration(self) -> float:
        return self.end - self.start


@attrs.frozen
class Timeline:
    """Simulated execution of a ``Program``.

    ``busy[r]`` sums rank r's compute/optimizer durations, ``idle[r] = makespan - busy[r]``.
    ``peak_memory[r]`` is the most stage-segment activations rank r holds at once, counted in
    "one segment's activations for one microbatch".
    """

    makespan: float
    busy: tuple[float, ...] = attrs.field(converter=tuple)
    idle: tuple[float, ...] = attrs.field(converter=tuple)
    peak_memory: tuple[int, ...] = attrs.field(converter=tuple)
    intervals: tuple[Interval, ...] = attrs.field(converter=tuple)

    @property
    def world_size(self) -> int:
        return len(self.busy)

    def of_rank(self, rank: int) -> list[Interval]:
        return [iv for iv in self.intervals if iv.rank == rank]
