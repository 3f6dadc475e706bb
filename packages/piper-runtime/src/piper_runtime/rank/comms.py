"""This rank's communicators, one per traffic class and direction, made from the program.

The backend makes them (``Backend.communicator``); this module decides which exist, in one
order on every rank (a group is created by every rank of the world, member or not):

1. one per program ``Communicator``, in program order: point-to-point classes (``pp.fwd``,
   ``pp.bwd``), each data-parallel group's collectives, and the forward collectives inside
   the compute of tensor/expert-parallel segments (traffic ``tp``/``ep``). A point-to-point
   communicator is told its channels, the (sender, receiver) pairs of the program's ``SEND``
   instructions on it, sorted (``channels``);
2. for each ``tp``/``ep`` communicator, right after it, a second one for the collectives of
   backward passes, so an overlapped forward and backward running on two threads never
   share a group;
3. one per device group of buckets whose gradients live sharded, for the early
   reduce-scatters issued from gradient hooks (``piper_runtime.rank.buckets``), in bucket order.

Two threads never issue collectives on one communicator: the plan's collectives run on the
lane of their stream (``streams.lanes_share_a_communicator`` falls back to one sequential
lane otherwise), compute's on the forward or backward one, early reductions on their own.
"""

from __future__ import annotations

from piper_ir import NodeKind, Program, Residency, ShardKind
from piper_runtime.backends.base import Backend, Communicator
from piper_runtime.rank.buckets import bucket_group


def channels(program: Program) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per communicator id, the sorted (sender, receiver) pairs of its ``SEND`` instructions."""
    pairs: dict[str, set[tuple[int, int]]] = {}
    for plan in program.ranks:
        for ins in plan.instructions:
            if ins.kind is NodeKind.SEND and ins.communicator is not None and ins.peer is not None:
                pairs.setdefault(ins.communicator, set()).add((plan.rank, ins.peer))
    return {comm: tuple(sorted(found)) for comm, found in pairs.items()}


class Communicators:
    """The backend communicators of one rank (module doc), by program communicator id."""

    def __init__(self, backend: Backend, program: Program) -> None:
        self.forward: dict[str, Communicator] = {}  # the plan's and compute's forward ones
        self.backward: dict[str, Communicator] = {}  # tp/ep collectives of backward passes
        self.early: dict[tuple[int, ...], Communicator] = {}  # device group -> early reductions
        pairs = channels(program)
        for comm in program.communicators:
            self.forward[comm.id] = backend.communicator(comm.ranks, pairs.get(comm.id, ()))
            if comm.traffic in tuple(ShardKind):
                self.backward[comm.id] = backend.communicator(comm.ranks)
        for bucket in program.buckets:
            group = bucket_group(program, bucket)
            if bucket.grads_home is Residency.SHARDED and len(group) > 1 and group not in self.early:
                self.early[group] = backend.communicator(group)

    def __getitem__(self, comm_id: str) -> Communicator:
        """The communicator the plan's instructions name as ``comm_id``."""
        return self.forward[comm_id]
