"""Which communicator carries which traffic.

Pipeline traffic has two classes, each on one communicator over all ranks: ``pp.fwd`` for
activations and ``pp.bwd`` for gradients (values named ``grad:<value>``). Separate
communicators keep the forward and backward message streams independent, so a schedule may
interleave them freely without breaking in-order matching on either.

Data-parallel traffic (collectives, MATERIALIZE) gets one communicator per device group and
stream: ``dp:<r0>-<r1>-...`` for the default stream ``dp`` (``dp.<stream>:<ranks>`` for
another), ranks in replica order, traffic ``dp``. The sums of a tied parameter's gradient
over the ranks holding it (stream ``tie``, ``piper_memory.plan_ties``) get
``tie:<r0>-<r1>-...``, traffic ``tie``. A stream's instructions run in list order,
so one communicator per stream keeps its collectives in one order on every member.

The global gradient norm (``GRAD_NORM``, one per step) sums one number over its devices
(the world) on a communicator of its own, ``norm:<r0>-<r1>-...`` (traffic ``norm``).

Tensor-parallel segments (``Graph.sharding``) get one communicator per shard group
(``Sharding.groups``: the whole device group, or each run of ``degree`` ranks when the
segment is also data-parallel), ``tp:<r0>-<r1>-...`` (traffic ``tp``): the all-reduces
inside their compute run on it; expert-parallel ones get ``ep:<r0>-<r1>-...`` (traffic
``ep``) for their all-to-alls. Every compute instruction of such a segment that issues
collectives names its rank's one.
"""

from __future__ import annotations

from collections.abc import Sequence

from piper_ir import TIE_STREAM, Communicator, Graph, NodeKind, is_grad
from piper_scheduler.kinds import GRAD_NORM, SEND

PP_FWD = "pp.fwd"
PP_BWD = "pp.bwd"
_TRAFFIC = {PP_FWD: "activations", PP_BWD: "gradients"}


def communicator_for(value: str) -> str:
    """The communicator id for a point-to-point transfer of ``value``."""
    return PP_BWD if is_grad(value) else PP_FWD


GROUP_COMM_KINDS = frozenset(
    {NodeKind.ALL_REDUCE, NodeKind.REDUCE_SCATTER, NodeKind.ALL_GATHER, NodeKind.MATERIALIZE}
)


# Bucket collectives of these streams are a traffic class of their own, not ``dp``.
_OWN_CLASS = frozenset({TIE_STREAM})


def group_communicator(stream: str, devices: Sequence[int]) -> str:
    """The communicator id of ``devices``' collectives on ``stream``: ``tie:<ranks>`` for the
    sums of tied parameters' gradients over their holders (stream ``tie``)."""
    prefix = stream if stream in _OWN_CLASS else "dp" if stream == "dp" else f"dp.{stream}"
    return f"{prefix}:{'-'.join(map(str, devices))}"


def group_traffic(stream: str) -> str:
    """The traffic class of a bucket collective on ``stream``."""
    return stream if stream in _OWN_CLASS else "dp"


def norm_communicator(devices: Sequence[int]) -> str:
    """The communicator id of the gradient norm's sum over ``devices``."""
    return f"norm:{'-'.join(map(str, devices))}"


def tp_communicator(devices: Sequence[int], kind: str = "tp") -> str:
    """The communicator id of a sharded group's collectives inside compute: ``tp:...`` for
    tensor parallelism, ``ep:...`` for the all-to-alls of expert parallelism."""
    return f"{kind}:{'-'.join(map(str, devices))}"


def communicators_for(graph: Graph) -> tuple[Communicator, ...]:
    """One communicator per traffic class the graph's SEND nodes use, in a fixed order, then
    one per (stream, device group) of its collectives, in order of first use in the graph,
    then one per tensor- or expert-parallel group whose segments issue collectives (traffic
    ``tp`` or ``ep``; a tensor- and expert-parallel segment has both, ``ep`` over its
    ``expert_degree`` ranks), then the gradient norm's (traffic ``norm``)."""
    # the values sent, told apart first: a pipeline's 130k transfers carry a few hundred
    used = {communicator_for(v) for v in {n.value or "" for n in graph.nodes if n.kind is SEND}}
    ranks = tuple(range(graph.world_size))
    out = [Communicator(c, ranks, _TRAFFIC[c]) for c in (PP_FWD, PP_BWD) if c in used]
    groups: dict[str, tuple[tuple[int, ...], str]] = {}
    for n in graph.nodes:
        if n.kind in GROUP_COMM_KINDS:
            groups.setdefault(group_communicator(n.stream, n.devices), (n.devices, group_traffic(n.stream)))
    out += [Communicator(c, ranks, traffic) for c, (ranks, traffic) in groups.items()]
    tp: dict[str, tuple[tuple[int, ...], str]] = {}
    for sh in graph.sharding:
        if sh.collectives:
            for group in sh.groups():
                tp.setdefault(tp_communicator(group, sh.kind), (group, sh.kind))
            if sh.expert_degree > 1:
                for group in sh.groups(sh.expert_degree):
                    tp.setdefault(tp_communicator(group, "ep"), (group, "ep"))
    out += [Communicator(c, ranks, kind) for c, (ranks, kind) in tp.items()]
    norms = {norm_communicator(n.devices): n.devices for n in graph.nodes if n.kind is GRAD_NORM}
    out += [Communicator(c, ranks, "norm") for c, ranks in norms.items()]
    return tuple(out)
