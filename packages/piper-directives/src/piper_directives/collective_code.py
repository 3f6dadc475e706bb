"""What the tensor- and expert-parallel rewrites' collective submodules share (torch side).

A rewritten segment calls its group's collectives through a submodule (``TensorParallelComm``,
``ExpertParallelComm``) that the runtime binds at the rank (``piper_runtime.rank.sharding``:
``bind_collectives`` calls ``bind_communicator``, ``collective_seconds`` reads and clears
``collective_times``). This package never calls ``torch.distributed``: the communicators are
whatever the runtime hands over.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

from torch import nn

C = TypeVar("C")  # the communicator protocol a group's collectives need
P = ParamSpec("P")


class GroupCollectives(nn.Module, Generic[C]):
    """The communicators of one shard group, held by the module whose code calls them.
    Unbound (the default) there is no group: one rank holds everything."""

    def __init__(self, degree: int) -> None:
        super().__init__()
        self.degree = degree
        self.comm: C | None = None
        # Backward passes get their own communicator: a forward and a backward may run at
        # once on two threads, and one communicator must not be used by both.
        self.backward_comm: C | None = None
        self.collective_times: list[float] = []  # seconds of each collective (the runtime reads, clears)

    @property
    def bound(self) -> bool:
        return self.comm is not None

    def bind_communicator(self, comm: C, backward_comm: C | None = None) -> None:
        """Called by the runtime with the communicator of the segment's shard group and the
        one for the collectives of backward passes (default: the same)."""
        self.comm = comm
        self.backward_comm = comm if backward_comm is None else backward_comm

    def timed(self, collective: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> None:
        """Run ``collective`` (a communicator's method), recording its seconds in
        ``collective_times``, so the runtime can tell communication from compute."""
        start = time.perf_counter()
        collective(*args, **kwargs)
        self.collective_times.append(time.perf_counter() - start)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        # Communicators are the rank's own (bound there); times belong to the rank's steps.
        state["comm"], state["backward_comm"] = None, None
        state["collective_times"] = []
        return state
