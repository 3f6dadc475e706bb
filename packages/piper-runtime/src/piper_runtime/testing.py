"""Helpers for tests that build ``Program``s by hand."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from piper_ir import Instruction


def with_stream_events(instructions: Sequence[Instruction]) -> list[Instruction]:
    """``instructions`` with the events a compiler would add, taken conservatively from the
    list order: each instruction waits for the latest earlier instruction of every other
    stream, so a threaded runtime runs them as the sequential order says."""
    latest: dict[str, str] = {}  # stream -> id of its latest instruction so far
    waits: dict[str, list[str]] = {}
    recorded: set[str] = set()
    for ins in instructions:
        for stream, nid in latest.items():
            if stream != ins.stream:
                waits.setdefault(ins.id, []).append(f"ev.{nid}")
                recorded.add(nid)
        latest[ins.stream] = ins.id
    return [
        attrs.evolve(ins, waits=tuple(waits.get(ins.id, ())), record=f"ev.{ins.id}" if ins.id in recorded else None)
        for ins in instructions
    ]
