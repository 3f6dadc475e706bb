"""Excerpts of rank plans for error messages, with ``<-- here`` at the culprit."""

from __future__ import annotations

from piper_ir import Program


def excerpt(program: Program, rank: int, index: int, *, context: int = 3) -> str:
    """Instructions ``index - context .. index + context`` of ``rank``, the culprit marked."""
    ins_list = program.ranks[rank].instructions
    lo, hi = max(0, index - context), min(len(ins_list), index + context + 1)
    lines = [f"  rank {rank} ({len(ins_list)} instructions):"]
    if lo > 0:
        lines.append("    ...")
    for i in range(lo, hi):
        ins = ins_list[i]
        mark = "  <-- here" if i == index else ""
        lines.append(f"    {i:>5}  [{ins.stream}] {ins.short():<28} {ins.id}{mark}")
    if index >= len(ins_list):
        lines.append(f"    {index:>5}  (end of plan)  <-- here")
    elif hi < len(ins_list):
        lines.append("    ...")
    return "\n".join(lines)


def excerpts(program: Program, slots: list[tuple[int, int]]) -> str:
    """Excerpts for several (rank, index) culprits, one block each."""
    return "\n".join(excerpt(program, rank, index) for rank, index in slots)


def describe(program: Program, rank: int, index: int) -> str:
    """One line naming an instruction: rank, stream, label and id."""
    ins = program.ranks[rank].instructions[index]
    return f"rank {rank} stream {ins.stream!r} instruction {index} {ins.id} ({ins.short()})"
