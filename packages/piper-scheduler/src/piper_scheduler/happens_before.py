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

_NOTHING: dict[str, int] = {}


class HappensBefore:
    """``precedes(a, b)`` for instruction indices of one rank (module doc). Requires the
    events checked (each waited event recorded once, earlier in the list)."""

    def __init__(self, plan: RankPlan) -> None:
        # Streams are told apart by name (a string's hash is cached, and one stream's
        # instructions share one name object): no table of stream numbers per instruction.
        stream_of: list[str] = []
        known_of: list[dict[str, int]] = []  # shared, never changed once appended
        recorder: dict[str, int] = {}
        latest: dict[str, dict[str, int]] = {}  # stream -> the clock of its last instruction so far
        add_stream, add_known, latest_of = stream_of.append, known_of.append, latest.get
        for i, ins in enumerate(plan.instructions):
            s = ins.stream
            known = latest_of(s, _NOTHING)
            if ins.waits:
                known = dict(known)
                for ev in ins.waits:
                    j = recorder[ev]
                    for stream, index in known_of[j].items():
                        if index > known.get(stream, -1):
                            known[stream] = index
                    if j > known.get(stream_of[j], -1):
                        known[stream_of[j]] = j
                latest[s] = known
            add_stream(s)
            add_known(known)
            if ins.record is not None:
                recorder[ins.record] = i
        self._stream = stream_of
        self._known = known_of

    def precedes(self, a: int, b: int) -> bool:
        """Whether instruction ``a`` finishes before instruction ``b`` starts."""
        if self._stream[a] == self._stream[b]:
            return a < b
        return self._known[b].get(self._stream[a], -1) >= a
