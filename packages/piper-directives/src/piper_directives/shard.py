"""``Shard``: tensor (``kind="tp"``) or expert (``kind="ep"``) parallelism over the device
group a ``Place`` made. This docstring describes ``tp``; for ``ep`` (the group stays
data-parallel for the non-expert weights) see ``_shard_experts`` and
docs/ir-conventions.md, section 9.

``Shard(filter, devices, kind="tp")`` says that the regions matched by ``filter``, placed on
``devices``, run SPMD as one tensor-parallel group: every rank of the group sees the *same*
data (not a batch shard, as with ``Replicate``) and holds a shard of the weights
(docs/ir-conventions.md, section 8).

``shard_all(graph, shards)`` runs inside ``place_all``, after the placement and before
``replicate_all``. Requires a placed graph. Guarantees:

- one ``Sharding(segment, devices, "tp", degree=len(devices))`` per matched segment in
  ``Graph.sharding``, with ``origin`` naming the directive; the loss segment, when it sits on
  a sharded group, gets one too (it runs replicated on the group);
- every segment placed on several devices is sharded (data parallelism and tensor
  parallelism do not mix yet: a group is one or the other), so ``replicate_all`` records no
  ``Replication`` for them and the batch is not sharded.

*What* is cut (``Sharding.params``) and the collectives inside a segment are decided
torch-side, from the segment's code, by ``piper_directives.shard_code.shard_modules``;
until then ``params`` is empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from piper_directives.place import _to_filter, placement_groups, segments_on_group
from piper_directives.source import user_location
from piper_ir import DirectiveError, Filter, Graph, SegmentRole, Sharding

KINDS = ("tp", "ep")


def _devices(value: object) -> tuple[int, ...]:
    return (value,) if isinstance(value, int) else tuple(value)  # type: ignore[arg-type]


@attrs.frozen
class Shard:
    """Run the regions matched by ``filter`` (placed on ``devices``) sharded over ``devices``.

    ``kind="tp"``: tensor-parallel, Megatron-style column/row-parallel Linear pairs,
    attention heads and MLP hidden units split across the group. ``kind="ep"``: expert
    parallel, the ranks are data-parallel replicas of everything but the experts, each
    holding ``E / N`` experts, tokens routed to them with all-to-alls."""

    filter: Filter = attrs.field(converter=_to_filter)
    devices: tuple[int, ...] = attrs.field(converter=_devices)
    kind: str = "tp"
    where: str = attrs.field(factory=user_location, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DirectiveError(
                f"kind must be one of {list(KINDS)}, got {self.kind!r}",
                directive=str(self),
            )
        if len(self.devices) < 2:
            raise DirectiveError(
                f"Shard needs a device group of at least two devices, got {list(self.devices)}",
                directive=str(self),
            )

    @property
    def degree(self) -> int:
        return len(self.devices)

    def __str__(self) -> str:
        return f"Shard({self.filter}, devices={list(self.devices)}, kind={self.kind!r}) at {self.where}"


def shard_all(graph: Graph, shards: Sequence[Shard], replicated: Sequence[object] = ()) -> Graph:
    """Record ``Graph.sharding`` for ``shards`` (module doc); ``replicated`` are the
    strategy's ``Replicate`` directives, refused on a tensor-parallel segment."""
    if not shards:
        return graph
    kinds = {s.kind for s in shards}
    if len(kinds) > 1:
        raise DirectiveError(
            "tensor and expert parallelism in one strategy are not supported yet", directive=str(shards[0])
        )
    if kinds == {"ep"}:
        return _shard_experts(graph, shards)
    group = placement_groups(graph)
    chosen: dict[str, Shard] = {}
    for shard in shards:
        for seg in segments_on_group(graph, shard, group):
            chosen.setdefault(seg.id, shard)
    loss = graph.loss_segment()
    if loss.id not in chosen:  # the loss runs, replicated, on the group of its producer
        owner = next((chosen[s] for s, g in group.items() if s in chosen and g == group.get(loss.id)), None)
        if owner is not None:
            chosen[loss.id] = owner
    for seg in graph.segments:
        devices = group.get(seg.id, ())
        if len(devices) > 1 and seg.id not in chosen:
            raise DirectiveError(
                f"segment {seg.id} ({seg.tags}) is placed on {list(devices)} without a Shard while other "
                "groups are tensor-parallel; data and tensor parallelism in one strategy are not supported yet",
                directive=str(shards[0]),
                nodes=[f"F.{seg.id}"],
            )
    for rep in replicated:
        raise DirectiveError(
            "Replicate together with Shard (data x tensor parallelism) is not supported yet",
            directive=str(rep),
        )
    sharding = tuple(
        Sharding(seg.id, chosen[seg.id].devices, chosen[seg.id].kind, chosen[seg.id].degree, origin=str(chosen[seg.id]))
        for seg in graph.segments
        if seg.id in chosen
    )
    return attrs.evolve(graph, sharding=sharding)


def _shard_experts(graph: Graph, shards: Sequence[Shard]) -> Graph:
    """Expert parallelism: one ``Sharding(kind="ep")`` per matched stage segment. The group
    stays a data-parallel group for everything else (``replicate_all`` replicates it, the
    batch is sharded), so the loss and unsharded segments need nothing here."""
    group = placement_groups(graph)
    chosen: dict[str, Shard] = {}
    for shard in shards:
        for seg in segments_on_group(graph, shard, group):
            if seg.role is SegmentRole.STAGE:
                chosen.setdefault(seg.id, shard)
    sharding = tuple(
        Sharding(seg.id, chosen[seg.id].devices, "ep", chosen[seg.id].degree, origin=str(chosen[seg.id]))
        for seg in graph.segments
        if seg.id in chosen
    )
    return attrs.evolve(graph, sharding=sharding)


def sharded_segments(graph: Graph) -> dict[str, Sharding]:
    return {s.segment: s for s in graph.sharding}


def tensor_parallel(strategy, tp: int):  # noqa: ANN001, ANN201 - Strategy in, Strategy out
    """``strategy``, a pipeline-only program over ``pp`` devices, with every region run
    tensor-parallel over ``tp`` adjacent devices: ``Place(filter, (r,))`` becomes
    ``Place(filter, (r*tp, ..., r*tp + tp - 1))`` plus a ``Shard`` over that group (tensor
    parallelism innermost, as Megatron lays it out: its all-reduces are the most frequent
    traffic). Split and Order stay as they are."""
    return _shard_every_stage(strategy, tp, "tp", "tensor_parallel")


def expert_parallel(strategy, ep: int):  # noqa: ANN001, ANN201 - Strategy in, Strategy out
    """``strategy``, a pipeline-only program over ``pp`` devices, with every region run
    expert-parallel over ``ep`` adjacent devices: ``Place(filter, (r,))`` becomes
    ``Place(filter, (r*ep, ..., r*ep + ep - 1))`` plus a ``Shard(kind="ep")`` over that group
    (the group is data-parallel for the non-expert weights; its all-to-alls stay within a
    stage's adjacent ranks). Split and Order stay as they are."""
    return _shard_every_stage(strategy, ep, "ep", "expert_parallel")


def _shard_every_stage(strategy, degree: int, kind: str, name: str):  # noqa: ANN001, ANN202
    from piper_directives.place import Place
    from piper_directives.replicate import Replicate
    from piper_directives.strategy import Strategy

    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise DirectiveError(f"{name}: {kind} must be a positive int, got {degree!r}")
    if degree == 1:
        return strategy
    out: list = []
    shards: list = []
    for d in strategy.directives:
        if isinstance(d, Place):
            if len(d.devices) != 1:
                raise DirectiveError(
                    f"{name}: the strategy is already replicated or sharded (a Place names several devices)",
                    directive=str(d),
                )
            group = tuple(d.devices[0] * degree + j for j in range(degree))
            out.append(Place(d.filter, group, d.stream, where=d.where))
            shards.append(Shard(d.filter, group, kind=kind, where=d.where))
        elif isinstance(d, Replicate | Shard):
            raise DirectiveError(f"{name}: the strategy already has a Replicate or Shard", directive=str(d))
        else:
            out.append(d)
    return Strategy([*out, *shards])
