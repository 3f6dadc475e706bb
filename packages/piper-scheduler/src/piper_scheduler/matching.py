"""How instructions of different ranks pair up: point-to-point channels and collectives.

Matching is in order, as NCCL and gloo do it: the k-th SEND from ``src`` to ``dst`` on a
communicator meets the k-th RECV on ``dst`` from ``src`` on that communicator, and the k-th
collective a member issues on a communicator meets every other member's k-th one. The
verifier checks that these pairs agree; the verifier's deadlock search and the simulator use
them to know which instruction unblocks which.
"""

from __future__ import annotations

from piper_ir import Instruction, NodeKind, Program
from piper_scheduler.kinds import COMPUTE, RECV, SEND

COLLECTIVE_KINDS = frozenset(
    {
        NodeKind.ALL_REDUCE,
        NodeKind.REDUCE_SCATTER,
        NodeKind.ALL_GATHER,
        NodeKind.ALL_TO_ALL,
        NodeKind.BROADCAST,
        NodeKind.MATERIALIZE,  # gathers a sharded bucket: every member takes part
        NodeKind.GRAD_NORM,  # sums one number over the world
    }
)

Channel = tuple[str, int, int]
"""(communicator, source rank, destination rank)."""

Slot = tuple[int, int]
"""(rank, index into that rank's instruction list)."""


def p2p_sequences(program: Program) -> tuple[dict[Channel, list[int]], dict[Channel, list[int]]]:
    """Per channel, the indices of its SENDs on the source and of its RECVs on the destination."""
    sends: dict[Channel, list[int]] = {}
    recvs: dict[Channel, list[int]] = {}
    for plan in program.ranks:
        r = plan.rank
        for i, ins in enumerate(plan.instructions):
            kind = ins.kind
            if kind is SEND:
                key = (ins.communicator or "", r, ins.peer or 0)
                index = sends.get(key)  # not ``setdefault``: it makes a list per call
                if index is None:
                    sends[key] = [i]
                else:
                    index.append(i)
            elif kind is RECV:
                key = (ins.communicator or "", ins.peer or 0, r)
                index = recvs.get(key)
                if index is None:
                    recvs[key] = [i]
                else:
                    index.append(i)
    return sends, recvs


def is_collective(ins: Instruction) -> bool:
    """A collective, or compute that issues collectives inside (a tensor-parallel segment's
    F/B/BI/BW names its group's communicator): every member must reach it."""
    return ins.kind in COLLECTIVE_KINDS or (ins.kind is COMPUTE and ins.communicator is not None)


def collective_sequences(program: Program) -> dict[str, dict[int, list[int]]]:
    """Per communicator and member rank, the indices of that rank's collectives on it."""
    out: dict[str, dict[int, list[int]]] = {}
    for plan in program.ranks:
        for i, ins in enumerate(plan.instructions):
            kind = ins.kind  # transfers (two thirds of a pipeline's instructions) are no collective
            if kind is not SEND and kind is not RECV and is_collective(ins):
                out.setdefault(ins.communicator or "", {}).setdefault(plan.rank, []).append(i)
    return out


def recv_partners(sends: dict[Channel, list[int]], recvs: dict[Channel, list[int]]) -> dict[Slot, Slot]:
    """Each RECV slot mapped to the SEND slot it matches (unmatched receives are left out)."""
    partners: dict[Slot, Slot] = {}
    for (comm, src, dst), rids in recvs.items():
        for r, s in zip(rids, sends.get((comm, src, dst), ()), strict=False):
            partners[(dst, r)] = (src, s)
    return partners


def collective_slots(
    program: Program, sequences: dict[str, dict[int, list[int]]] | None = None
) -> dict[Slot, tuple[str, int]]:
    """Each collective slot mapped to (communicator, its position in the member's sequence).
    ``sequences``: ``collective_sequences(program)``, when the caller has it already."""
    out: dict[Slot, tuple[str, int]] = {}
    if sequences is None:
        sequences = collective_sequences(program)
    for comm, by_rank in sequences.items():
        for rank, idx in by_rank.items():
            for k, i in enumerate(idx):
                out[(rank, i)] = (comm, k)
    return out
