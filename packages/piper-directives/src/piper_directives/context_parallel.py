"""``ContextParallel``: sequences cut along dimension 1 over a device group (context
parallelism, ``ShardKind.CP``); docs/context-parallel.md.

``ContextParallel(filter, devices, degree=len(devices))`` says that the regions matched by
``filter``, placed on ``devices``, run in context-parallel groups of ``degree`` consecutive
ranks: each rank of a group holds chunk ``position`` of every sequence of its batch shard
(``T / degree`` tokens, dimension 1 of every input) and the whole model. With ``degree <
len(devices)`` the groups are data-parallel replicas of each other (DP x CP).

For the runtime a context-parallel group *is* a data-parallel group: its ranks hold the same
weights, compute on different pieces of the batch and sum their gradients (a ``Replication``
over the whole group, ZeRO included). Only the pieces differ: the driver's batch is laid out
so that piece ``dp_replica * degree + position`` of a microbatch is that chunk of the
sequences (``piper_directives.context_code.ContextLayout``), and attention gathers the keys
and values of the whole sequence over the group (``context_code``). Two phases of
``Strategy.apply`` record it:

- ``context_all`` (before ``Replicate``): multiplies the batch dimension of every value by
  ``degree``, so that ``replicate_all``, cutting each microbatch among all ``len(devices)``
  ranks, leaves each rank the sequences of its data-parallel shard, whole, until the code
  rewrite (``context_code.context_modules``) gives every value its local sequence length;
- ``context_records`` (after ``Replicate``): one ``Sharding(segment, devices, "cp",
  degree)`` per matched segment and for the loss segment of a matched group, so the
  scheduler makes a ``cp:<ranks>`` communicator per group for the gathers inside compute.

Refused: a group smaller than two, a ``degree`` that is not an int >= 2 dividing the group,
context parallelism with ``Shard`` (tensor or expert parallelism) in one strategy, a region
placed on other devices than the directive names, ``ContextParallel``s of different degrees,
and a multi-device group left without one while others have it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import attrs

from piper_directives.common import (
    JsonObject,
    check_degree,
    devices_from_json,
    filter_from_json,
    to_devices,
    to_filter,
    user_location,
    written_at_or,
)
from piper_directives.groups import directive_per_segment, placement_groups
from piper_ir import DirectiveError, Filter, Graph, Sharding, ShardKind, TensorMeta, Value

if TYPE_CHECKING:
    from piper_directives.strategy import Strategy


@attrs.frozen
class ContextParallel:
    """Cut the sequences of the regions matched by ``filter`` (placed on ``devices``) over
    groups of ``degree`` consecutive devices (module doc)."""

    op: ClassVar[str] = "context_parallel"

    filter: Filter = attrs.field(converter=to_filter)
    devices: tuple[int, ...] = attrs.field(converter=to_devices)
    degree: int = attrs.field(default=attrs.Factory(lambda self: len(self.devices), takes_self=True))
    where: str = attrs.field(factory=user_location, eq=False)

    def __attrs_post_init__(self) -> None:
        if len(self.devices) < 2:
            raise DirectiveError(
                f"ContextParallel needs a device group of at least two devices, got {list(self.devices)}",
                directive=str(self),
            )
        check_degree(str(self), self.devices, self.degree,
                     "the ranks each sequence is cut over; the groups are data-parallel replicas")

    def __str__(self) -> str:
        degree = "" if self.degree == len(self.devices) else f", degree={self.degree}"
        return f"ContextParallel({self.filter}, devices={list(self.devices)}{degree}) at {self.where}"

    def to_json(self) -> JsonObject:
        out = {"op": self.op, "filter": self.filter.as_dict(), "devices": list(self.devices)}
        return out if self.degree == len(self.devices) else {**out, "degree": self.degree}

    @classmethod
    def from_json(cls, item: JsonObject, where: str) -> ContextParallel:
        return cls(**{**item, "filter": filter_from_json(item["filter"], where),
                      "devices": devices_from_json(item["devices"], where)}, where=where)


def _chosen(graph: Graph, cps: Sequence[ContextParallel]) -> dict[str, ContextParallel]:
    """Segment id -> the directive that makes it context-parallel (module doc's refusals)."""
    degrees = {c.degree for c in cps}
    if len(degrees) > 1:
        raise DirectiveError(
            f"ContextParallels of different degrees {sorted(degrees)} in one strategy: every sequence is cut "
            "into the same chunks everywhere",
            directive=str(cps[0]),
        )
    if graph.sharding:
        raise DirectiveError(
            f"context parallelism with {graph.sharding[0].kind}-parallelism (Shard) in one strategy is not "
            "supported yet",
            directive=str(cps[0]),
        )
    return directive_per_segment(
        graph, cps, placement_groups(graph),
        "a ContextParallel while other groups cut their sequences; give every multi-device group one (data x "
        "context parallelism: ContextParallel(..., degree=k) over the whole group)",
    )


def context_all(graph: Graph, cps: Sequence[ContextParallel]) -> Graph:
    """The pre-``Replicate`` phase (module doc): every value's batch dimension times the
    degree, so the ranks of one group end up with the same sequences."""
    made = next((sh for sh in graph.sharding if sh.kind is ShardKind.CP), None)
    if made is not None:  # only this module records cp shardings, and only after Replicate
        raise DirectiveError(
            "Shard(kind='cp') is not context parallelism: cut sequences with ContextParallel(filter, devices)",
            directive=made.origin,
        )
    if not cps:
        return graph
    _chosen(graph, cps)
    degree = cps[0].degree

    def widened(meta: TensorMeta) -> TensorMeta:
        if meta.batch_dim is None:
            return meta
        shape = list(meta.shape)
        shape[meta.batch_dim] *= degree
        return attrs.evolve(meta, shape=tuple(shape))

    return attrs.evolve(graph, values=tuple(Value(v.name, widened(v.meta)) for v in graph.values))


def context_records(graph: Graph, cps: Sequence[ContextParallel]) -> Graph:
    """The post-``Replicate`` phase (module doc): a ``Sharding(kind="cp")`` per matched segment.
    ``collectives`` stays 0 until ``context_code.context_modules`` rewrites the code."""
    if not cps:
        return graph
    chosen = _chosen(graph, cps)
    records = tuple(
        Sharding(seg.id, chosen[seg.id].devices, ShardKind.CP, chosen[seg.id].degree, origin=str(chosen[seg.id]))
        for seg in graph.segments
        if seg.id in chosen
    )
    return attrs.evolve(graph, sharding=records)


def context_parallel(strategy: Strategy, cp: int) -> Strategy:
    """``strategy`` (a pipeline program, optionally data-parallel) with every region's
    sequences cut over ``cp`` adjacent devices: device ``d`` becomes ``d*cp, ..., d*cp + cp -
    1``; each ``Place`` gets a ``ContextParallel(degree=cp)`` over its widened group and each
    ``Replicate`` moves onto it (DP x CP: the replicas reduce over the whole group, as the
    context-parallel ranks of one replica do). Split and Order stay. Refused: a strategy with
    a ``Shard`` (tensor or expert parallelism) or one already context-parallel."""
    from piper_directives.place import Place
    from piper_directives.replicate import Replicate
    from piper_directives.shard import Shard
    from piper_directives.strategy import Strategy

    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise DirectiveError(f"cp must be a positive int, got {cp!r}")
    if cp == 1:
        return strategy

    def widen(devices: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(d * cp + j for d in devices for j in range(cp))

    out: list = []
    for d in strategy.directives:
        if isinstance(d, Place):
            group = widen(d.devices)
            out.append(Place(d.filter, group, d.stream, where=d.where))
            out.append(ContextParallel(d.filter, group, degree=cp, where=written_at_or(d.where)))
        elif isinstance(d, Replicate):
            out.append(attrs.evolve(d, devices=widen(d.devices)))
        elif isinstance(d, Shard | ContextParallel):
            raise DirectiveError(
                f"context_parallel: the strategy already has a {type(d).__name__}; context parallelism with "
                "tensor or expert parallelism is not supported yet",
                directive=str(d),
            )
        else:
            out.append(d)
    return Strategy(out)
