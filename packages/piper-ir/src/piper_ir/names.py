"""Naming conventions of IR values and node ids, written down once.

The gradient of value ``v`` is the value ``grad:v`` (same meta): capture creates it, the
scheduler routes it on the backward communicator, the memory estimate and the runtime
accumulate it. Every package builds and reads such names through these helpers only.

Node ids (docs/ir-conventions.md): a compute or optimizer node is ``<phase>.<segment>``
(``F.s0``, ``OPT.s0``), one microbatch's copy of a node gets ``.mb<i>`` (``F.s0.mb1``), a
transfer is a ``send.``/``recv.`` pair named after its value, microbatch and device groups,
and the event an instruction records for another stream is ``ev.<id>``. The ids are part of
serialized programs and of tests, so these helpers spell them exactly as they always were.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from piper_ir.tags import Phase

GRAD_PREFIX = "grad:"
MICROBATCH_INFIX = ".mb"
EVENT_PREFIX = "ev."


def grad_name(value: str) -> str:
    """The name of ``value``'s gradient."""
    return GRAD_PREFIX + value


def is_grad(name: str) -> bool:
    """Whether ``name`` is the gradient of another value."""
    return name.startswith(GRAD_PREFIX)


def grad_of(name: str) -> str:
    """The value that gradient ``name`` belongs to (``grad_of(grad_name(v)) == v``)."""
    if not is_grad(name):
        raise ValueError(f"{name!r} is not a gradient value (no {GRAD_PREFIX!r} prefix)")
    return name[len(GRAD_PREFIX) :]


def compute_id(phase: Phase, segment: str, microbatch: int | None = None) -> str:
    """The id of ``segment``'s node of ``phase`` (compute, or optimizer for ``Phase.OPT``):
    ``<phase>.<segment>``, and ``.mb<i>`` for one microbatch's (``microbatch_id``)."""
    return microbatch_id(f"{phase.value}.{segment}", microbatch)


def microbatch_id(node_id: str, microbatch: int | None) -> str:
    """The id of ``node_id``'s copy for ``microbatch`` (``Split``): ``<id>.mb<i>``; ``node_id``
    itself for ``None`` (a node run once per step)."""
    return node_id if microbatch is None else f"{node_id}{MICROBATCH_INFIX}{microbatch}"


def backward_halves(node_id: str) -> tuple[str, str]:
    """The ids of the ``BI`` and ``BW`` nodes a fused backward ``node_id`` is split into:
    ``B.s1.mb0`` -> ``BI.s1.mb0``, ``BW.s1.mb0``. An id not in the ``B.`` style (a hand-built
    graph's) gets the phase put in front."""
    rest = node_id.removeprefix(f"{Phase.B.value}.")
    return f"{Phase.BI.value}.{rest}", f"{Phase.BW.value}.{rest}"


def transfer_ids(value: str, microbatch: int | None, senders: Sequence[int], receivers: Sequence[int]) -> tuple[str, str]:
    """The ids of the ``SEND``/``RECV`` pair carrying ``value`` (of ``microbatch``) from the
    device group ``senders`` to ``receivers``, paired elementwise:
    ``send.<value>[.mb<i>].<s0_s1>-<r0_r1>`` and the same with ``recv.``."""
    ends = _ends(tuple(senders), tuple(receivers))
    carried = microbatch_id(value, microbatch)
    return f"send.{carried}.{ends}", f"recv.{carried}.{ends}"


@functools.lru_cache(maxsize=4096)
def _ends(senders: tuple[int, ...], receivers: tuple[int, ...]) -> str:
    """``<s0_s1>-<r0_r1>`` of ``transfer_ids``, made once per pair of groups: a pipeline has a
    few, and its transfers (130k at 16,384 devices) name them again and again."""
    return f"{'_'.join(map(str, senders))}-{'_'.join(map(str, receivers))}"


def event_id(node_id: str) -> str:
    """The event instruction ``node_id`` records for the instructions of other streams that
    wait for it (``Instruction.record``/``waits``): ``ev.<id>``."""
    return EVENT_PREFIX + node_id
