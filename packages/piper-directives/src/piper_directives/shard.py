"""``Shard``: tensor (``kind="tp"``, ``ShardKind.TP``) or expert (``kind="ep"``,
``ShardKind.EP``) parallelism over the device group a ``Place`` made. This docstring
describes ``tp``; for ``ep`` (the group stays data-parallel for the non-expert weights) see
``_shard_experts`` and docs/ir-conventions.md, section 9.

``Shard(filter, devices, kind="tp", degree=len(devices))`` says that the regions matched by
``filter``, placed on ``devices``, run SPMD in tensor-parallel groups of ``degree``
consecutive ranks of ``devices``: every rank of one such group sees the *same* data (not a
batch shard, as with ``Replicate``) and holds a shard of the weights (docs/ir-conventions.md,
section 8). With ``degree < len(devices)`` the ``len(devices) / degree`` groups are
data-parallel replicas of each other (DP x TP): ``devices`` is replica-major, the ranks at
one position of every group hold the same shard and reduce its gradients (a ``Replicate`` on
the same devices sets the ZeRO level).

``shard_all(graph, shards)`` is the Shard phase of ``Strategy.apply``: after Place, before
Replicate (``replicate_all`` reads ``Graph.sharding``). Requires a placed graph. Guarantees:

- one ``Sharding(segment, devices, "tp", degree)`` per matched segment in
  ``Graph.sharding``, with ``origin`` naming the directive; the loss segment, when it sits on
  a sharded group, gets one too (it runs on each tensor-parallel group, on whole logits, or on
  vocabulary slices as a parallel cross-entropy: ``shard_vocab``);
- every segment placed on several devices is sharded, all with one degree (a group is
  tensor-parallel, or data x tensor parallel with the same number of replicas everywhere);
  ``replicate_all`` records a ``Replication`` only where ``degree < len(devices)``, and the
  batch is cut into ``len(devices) / degree`` shards.

*What* is cut (``Sharding.params``) and the collectives inside a segment are decided
torch-side, from the segment's code, by ``piper_directives.shard_code.shard_modules``;
until then ``params`` is empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

import attrs

from piper_directives.common import (
    JsonObject,
    check_degree,
    devices_from_json,
    filter_from_json,
    to_devices,
    to_filter,
    user_location,
)
from piper_directives.groups import OnGroup, directive_per_segment, placement_groups, segments_on_group
from piper_ir import DirectiveError, Filter, Graph, SegmentRole, Sharding, ShardKind

#: Plan styles: Linears cut on their outputs / inputs (``shard_groups``), by vocabulary the head
#: (its logits sliced, the loss a parallel cross-entropy) and the embedding (``shard_vocab``), and
#: an expert module's experts split over the group (``expert_code.shard_experts_tp``).
PLAN_STYLES = ("colwise", "rowwise", "colwise_vocab", "embedding_vocab", "experts")


def _to_plan(value: object) -> object:
    """attrs converter: a mapping (or pairs) of module-path pattern -> style, as a tuple of
    pairs in the given order; anything else is kept for ``__attrs_post_init__`` to refuse."""
    if value is None:
        return ()
    try:
        items = value.items() if hasattr(value, "items") else value
        return tuple((k, v) for k, v in items)
    except (TypeError, ValueError):
        return value


def _to_kind(value: object) -> object:
    """attrs converter: a ``ShardKind`` (``"tp"`` or ``"ep"``); anything else is kept for
    ``Shard.__attrs_post_init__`` to refuse with the directive named."""
    try:
        return ShardKind(value)
    except (ValueError, TypeError):
        return value


@attrs.frozen
class Shard:
    """Run the regions matched by ``filter`` (placed on ``devices``) sharded over ``devices``.

    ``kind="tp"``: tensor-parallel, Megatron-style column/row-parallel Linear pairs and
    column groups, attention heads and MLP hidden units split across the group; ``plan``
    (``{"layers.*.attention.wq": "colwise", "layers.*.attention.wo": "rowwise"}``) names the
    Linears to cut instead of finding them (``shard_code``). ``kind="ep"``: expert
    parallel, the ranks are data-parallel replicas of everything but the experts, each
    holding ``E / N`` experts, tokens routed to them with all-to-alls.

    ``sequence_parallel=True`` (``kind="tp"``): the norms, dropout and residual adds between
    the tensor-parallel regions run on sequence shards, the rows' all-reduces becoming
    reduce-scatters and the columns' inputs all-gathered (``shard_sequence``). An option of
    the tensor-parallel Shard rather than a kind of its own: the groups, the cut weights and
    the communicators are tensor parallelism's, only the collectives inside differ.

    ``expert_degree`` (``kind="tp"``): tensor with expert parallelism. The expert modules'
    experts are split over runs of ``expert_degree`` consecutive ranks of ``devices`` (a
    multiple of ``degree``: that many tensor-parallel groups, data-parallel replicas of each
    other, which a ``Replicate`` on the same devices makes so), each rank holding ``E /
    expert_degree`` experts; each rank of a tensor-parallel group routes its share of the
    group's tokens to them with all-to-alls (as Megatron and torchtitan's expert parallelism
    borrows the tensor-parallel ranks). Attention and the rest stay tensor-parallel."""

    op: ClassVar[str] = "shard"

    filter: Filter = attrs.field(converter=to_filter)
    devices: tuple[int, ...] = attrs.field(converter=to_devices)
    kind: ShardKind = attrs.field(default=ShardKind.TP, converter=_to_kind)
    degree: int = attrs.field(default=attrs.Factory(lambda self: len(self.devices), takes_self=True))
    plan: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_to_plan)
    sequence_parallel: bool = False
    expert_degree: int = 1
    where: str = attrs.field(factory=user_location, eq=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.kind, ShardKind):
            raise DirectiveError(
                f"kind must be one of {[k.value for k in ShardKind]}, got {self.kind!r}",
                directive=str(self),
            )
        if len(self.devices) < 2:
            raise DirectiveError(
                f"Shard needs a device group of at least two devices, got {list(self.devices)}",
                directive=str(self),
            )
        if self.plan:
            bad = self.kind is not ShardKind.TP or not isinstance(self.plan, tuple) or any(
                not isinstance(k, str) or not k or v not in PLAN_STYLES for k, v in self.plan
            )
            if bad:
                raise DirectiveError(
                    f"plan must map module paths ('layers.*.attention.wq', '*' one path component) to one of "
                    f"{list(PLAN_STYLES)}, for kind='tp'; got {self.plan!r}",
                    directive=str(self),
                )
        if self.sequence_parallel is not False and (self.sequence_parallel is not True or self.kind is not ShardKind.TP):
            raise DirectiveError(
                f"sequence_parallel must be True or False, and True only for kind='tp'; got {self.sequence_parallel!r}",
                directive=str(self),
            )
        check_degree(str(self), self.devices, self.degree,
                     "the size of each shard group; the groups are data-parallel replicas")
        if self.expert_degree != 1:
            ok = (self.kind is ShardKind.TP and isinstance(self.expert_degree, int)
                  and not isinstance(self.expert_degree, bool) and self.expert_degree > self.degree
                  and self.expert_degree % self.degree == 0 and len(self.devices) % self.expert_degree == 0)
            if not ok:
                raise DirectiveError(
                    f"expert_degree must be a multiple of the degree ({self.degree}) above it that divides the "
                    f"{len(self.devices)} devices, for kind='tp'; got {self.expert_degree!r}",
                    directive=str(self),
                )
            if self.sequence_parallel:
                raise DirectiveError(
                    "sequence parallelism with an expert-parallel group (expert_degree) is not supported yet",
                    directive=str(self),
                )

    def __str__(self) -> str:
        degree = "" if self.degree == len(self.devices) else f", degree={self.degree}"
        kind = self.kind.value if isinstance(self.kind, ShardKind) else self.kind
        plan = f", plan={dict(self.plan)}" if self.plan and isinstance(self.plan, tuple) else ""
        sp = ", sequence_parallel=True" if self.sequence_parallel is True else ""
        ep = f", expert_degree={self.expert_degree}" if self.expert_degree != 1 else ""
        return f"Shard({self.filter}, devices={list(self.devices)}, kind={kind!r}{degree}{plan}{sp}{ep}) at {self.where}"

    def to_json(self) -> JsonObject:
        out = {"op": self.op, "filter": self.filter.as_dict(), "devices": list(self.devices), "kind": self.kind.value}
        if self.plan:
            out["plan"] = dict(self.plan)
        if self.sequence_parallel:
            out["sequence_parallel"] = True
        if self.expert_degree != 1:
            out["expert_degree"] = self.expert_degree
        return out if self.degree == len(self.devices) else {**out, "degree": self.degree}

    @classmethod
    def from_json(cls, item: JsonObject, where: str) -> Shard:
        return cls(**{**item, "filter": filter_from_json(item["filter"], where),
                      "devices": devices_from_json(item["devices"], where)}, where=where)


def mixed_kinds_problem(kinds: Iterable[ShardKind]) -> str | None:
    """Why Shards of these kinds cannot share one strategy, or None: ``shard_all`` applies it
    to a strategy's Shards (tensor with expert parallelism is one tensor-parallel Shard with an
    ``expert_degree``)."""
    if len(set(kinds)) > 1:
        return ("Shards of different kinds in one strategy are not supported; for tensor with expert parallelism "
                "give the tensor-parallel Shard an expert_degree (parallelize(tp=, ep=) does)")
    return None


def shard_all(graph: Graph, shards: Sequence[Shard], replicated: Sequence[OnGroup] = ()) -> Graph:
    """Record ``Graph.sharding`` for ``shards`` (module doc); ``replicated`` are the
    strategy's ``Replicate`` directives, refused on a tensor-parallel group without
    data-parallel replicas (``degree == len(devices)``)."""
    if not shards:
        return graph
    kinds = {s.kind for s in shards}
    mixed = mixed_kinds_problem(kinds)
    if mixed is not None:
        raise DirectiveError(mixed, directive=str(shards[0]))
    degrees = {s.degree for s in shards}
    if len(degrees) > 1:
        raise DirectiveError(
            f"Shards of different degrees {sorted(degrees)} in one strategy: every shard group has the "
            "same size, so every group has the same number of data-parallel replicas",
            directive=str(shards[0]),
        )
    if kinds == {ShardKind.EP}:
        return _shard_experts(graph, shards)
    group = placement_groups(graph)
    chosen = directive_per_segment(
        graph, shards, group,
        "a Shard while other groups are tensor-parallel; shard every multi-device group (data x tensor "
        "parallelism: Shard(..., degree=k) over the whole group, plus a Replicate for the ZeRO level)",
    )
    pure = {s.devices for s in chosen.values() if s.degree == len(s.devices)}
    for rep in replicated:
        if rep.devices in pure:
            raise DirectiveError(
                "Replicate on a tensor-parallel group that has no data-parallel replicas (its Shard's degree "
                "is the group size); for data x tensor parallelism place the regions on dp x tp devices and "
                "give the Shard degree=tp",
                directive=str(rep),
            )
    sharding = tuple(
        Sharding(seg.id, chosen[seg.id].devices, chosen[seg.id].kind, chosen[seg.id].degree, origin=str(chosen[seg.id]),
                 plan=chosen[seg.id].plan, sequence_parallel=chosen[seg.id].sequence_parallel,
                 expert_degree=chosen[seg.id].expert_degree if seg.role is SegmentRole.STAGE else 1)
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
        Sharding(seg.id, chosen[seg.id].devices, ShardKind.EP, chosen[seg.id].degree, origin=str(chosen[seg.id]))
        for seg in graph.segments
        if seg.id in chosen
    )
    return attrs.evolve(graph, sharding=sharding)
