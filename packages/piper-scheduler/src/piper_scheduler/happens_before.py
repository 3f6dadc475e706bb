"""Which instructions of one rank finish before which others start, on any runtime.

A sequential runtime walks a rank's list; a threaded one runs each stream on its own worker
and orders streams only through events (``Program``). So ``a`` surely precedes ``b`` when
both sit on one stream with ``a`` first, or when a chain of same-stream steps and waited
events leads from ``a`` to ``b``: the order both runtimes keep. ``verify`` asks this for the
pairs a step's meaning needs (a backward after its forward, a send after what it sends).

Each instruction keeps, per other stream, the last index of that stream known to finish
before it starts (a vector clock). Instructions that wait on nothing share their stream
predecessor's clock, so building it is linear in the plan plus the events times the streams
(a handful), and a query is two list lookups.
"""

from __future__ import annotations

from piper_ir import RankPlan

_NOTHING: dict[int, int] = {}


class HappensBefore:
    """``precedes(a, b)`` for instruction indices of one rank (module doc). Requires the
    events checked (each waited event recorded once, earlier in the list)."""

    def __init__(self, plan: RankPlan) -> None:
        streams: dict[str, int] = {}
        stream_of: list[int] = []
        known_of: list[dict[int, int]] = []  # shared, never changed once appended
        recorder: dict[str, int] = {}
        latest: dict[int, dict[int, int]] = {}  # stream -> the clock of its last instruction so far
        for i, ins in enumerate(plan.instructions):
            s = streams.get(ins.stream)
            if s is None:
                s = streams[ins.stream] = len(streams)
            known = latest.get(s, _NOTHING)
            if ins.waits:
                known = dict(known)
                for ev in ins.waits:
                    j = recorder[ev]
                    for stream, index in known_of[j].items():
                        if index > known.get(stream, -1):
                            known[stream] = index
                    if j > known.get(stream_of[j], -1):
                        known[stream_of[j]] = j
            stream_of.append(s)
            known_of.append(known)
            latest[s] = known
            if ins.record is not None:
                recorder[ins.record] = i
        self._stream = stream_of
        self._known = known_of

    def precedes(self, a: int, b: int) -> bool:
        """Whether instruction ``a`` finishes before instruction ``b`` starts."""
        if self._stream[a] == self._stream[b]:
            return a < b
        return self._known[b].get(self._stream[a], -1) >= a
