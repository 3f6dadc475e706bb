"""Composing parallelisms over a pipeline program: data, tensor and expert parallelism.

``parallelize(pipeline, dp=, zero=, tp=, ep=)`` is the one place that composes them;
``build_schedule``, every schedule builder's ``dp``/``zero`` keywords, the ``piper`` command
(``--dp/--zero/--tp/--ep``, over a library schedule or a ``--strategy`` file) and
``Trainer.with_schedule`` all go through it. It rewrites directives only (Place, and the
Replicate and Shard it adds); Split and Order stay as written, since an ``Order`` orders
every device of a group alike.

Device layout, with ``pp`` pipeline ranks and ``k`` = tp or ep (1 without either): stage
``r`` of data-parallel replica ``j`` runs on devices ``(r + j * pp) * k + t`` for ``t < k``.
``--pp 2 --dp 2 --tp 2`` is 8 devices, stage 0 on (0, 1) and (4, 5), stage 1 on (2, 3) and
(6, 7). The building blocks, ``data_parallel``, ``tensor_parallel`` and ``expert_parallel``,
each do one rewrite and are public for strategies composed by hand. ``check_degrees`` holds
the rules on the degrees themselves, once, for all of them and for front ends that check
their options before composing anything (the ``piper`` command).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from piper_directives.common import written_at_or
from piper_directives.groups import segment_group
from piper_directives.place import Place
from piper_directives.replicate import DEFAULT_BUCKET_MB, Replicate
from piper_directives.shard import Shard
from piper_directives.strategy import Directive, Strategy
from piper_ir import MB, DirectiveError, Filter, ShardKind


class DegreeError(DirectiveError):
    """A degree or ZeRO level ``check_degrees`` refuses. ``options`` names the keywords at
    fault (``("zero", "dp")``), so a front end can name them in its own spelling (the
    ``piper`` command's ``--zero``/``--dp``) without restating the rule. ``fields``: those of
    ``PiperError`` (an unpickled copy comes back through them, without ``options``)."""

    def __init__(self, message: str, *, options: Sequence[str] = (), **fields: Any) -> None:
        self.options = tuple(options)
        super().__init__(message, **fields)


def check_degrees(caller: str | None = None, *, dp: int = 1, zero: int = 0, tp: int = 1, ep: int = 1) -> None:
    """The one statement of the rules on parallelism degrees, which ``parallelize`` and its
    building blocks apply and the ``piper`` command relies on: each degree a positive int,
    ``zero`` a ZeRO level (0-3) with replicas to shard over (``dp >= 2``, or ``ep >= 2``: an
    expert-parallel group is data-parallel for its non-expert weights). ``caller`` prefixes
    the message (the function the user called). Raises ``DegreeError``."""
    prefix = f"{caller}: " if caller else ""
    for what, v in (("dp", dp), ("tp", tp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DegreeError(f"{prefix}{what} must be a positive int, got {v!r}", options=(what,))
    if isinstance(zero, bool) or not isinstance(zero, int) or zero not in (0, 1, 2, 3):
        raise DegreeError(f"{prefix}zero must be one of 0, 1, 2, 3, got {zero!r}", options=("zero",))
    if zero and dp < 2 and ep < 2:
        raise DegreeError(
            f"{prefix}ZeRO-{zero} shards over data-parallel replicas; it needs dp >= 2 (or ep >= 2, whose "
            "group is data-parallel for the non-expert weights)",
            options=("zero", "dp"),
        )


def parallelize(pipeline: Strategy, *, dp: int = 1, zero: int = 0, tp: int = 1, ep: int = 1,
                tp_plan: Mapping[str, str] | None = None, sp: bool = False) -> Strategy:
    """``pipeline`` (a pipeline-only program: one device per ``Place``, no Replicate or
    Shard) over ``dp`` data-parallel replicas with ZeRO level ``zero``, each stage of each
    replica tensor-parallel over ``tp`` or expert-parallel over ``ep`` adjacent devices
    (module doc for the layout), or both: ``ep`` tensor-parallel groups side by side, data-parallel
    replicas for all but the experts, which are split over their ``tp * ep`` ranks
    (``Shard.expert_degree``). With every degree 1 and ``zero=0``, ``pipeline`` itself.
    ``tp_plan``: the ``Shard``s' plan by module path (``tensor_parallel``'s ``plan``); ``sp``:
    sequence parallelism (``tensor_parallel``'s, needs ``tp > 1``)."""
    check_degrees("parallelize", dp=dp, zero=zero, tp=tp, ep=ep)
    if sp and tp < 2:
        raise DegreeError("parallelize: sequence parallelism (sp) shards the code between tensor-parallel "
                          "regions; it needs tp >= 2", options=("sp", "tp"))
    if sp and ep > 1:
        raise DegreeError("parallelize: sequence parallelism (sp) with expert parallelism (ep) is not supported yet",
                          options=("sp", "ep"))
    if tp > 1 and ep > 1:
        # The ep groups are data-parallel replicas of each other (innermost of them), the
        # experts split over their tp * ep ranks: tensor_parallel's expert_degree.
        return tensor_parallel(data_parallel(pipeline, dp * ep, zero), tp, plan=tp_plan or None, ep=ep)
    if ep > 1 and dp == 1:
        # An expert-parallel group is data-parallel for everything but the experts by itself
        # (the batch is cut among its ranks), so ZeRO applies to it without data-parallel
        # replicas: expert_parallel adds the Replicate.
        return expert_parallel(pipeline, ep, zero=zero or None)
    # Data parallelism first, on the pipeline-only program: it copies whole pipelines
    # (replica j of rank r on r + j * pp), so activations stay within one copy and the
    # replicas meet only to reduce gradients, the least frequent traffic (once per step per
    # bucket; per microbatch with ZeRO-2/3): the replicas may sit furthest apart.
    replicated = data_parallel(pipeline, dp, zero)
    # Tensor or expert parallelism last, innermost: each device d becomes d * k .. d * k + k - 1,
    # so a shard group is k adjacent devices. Their collectives are the most frequent
    # traffic (all-reduces in every Linear pair, all-to-alls around every expert call, each
    # microbatch), so they get the nearest devices, as Megatron lays it out; the Replicates
    # data_parallel added move onto the widened groups, which makes DP x TP (DP x EP).
    if ep > 1:
        return expert_parallel(replicated, ep)
    return tensor_parallel(replicated, tp, plan=tp_plan or None, sp=sp)


def data_parallel(strategy: Strategy, dp: int, zero: int = 0, *, bucket_mb: float = DEFAULT_BUCKET_MB) -> Strategy:
    """``strategy``, a pipeline-only program over ``pp`` devices, replicated ``dp`` times.

    Each ``Place(filter, (r,))`` becomes ``Place(filter, (r, r + pp, ..., r + (dp - 1) * pp))``
    and gets a ``Replicate(filter, that group, zero, bucket_mb)``; Split and Order stay as they
    are (an Order orders each device of a group alike). Replica j of every rank thus forms the
    j-th copy of the whole pipeline, and activations flow only within one copy. A region
    placed per microbatch set on several ranks (``MB`` in the filter, DualPipe's mirrored
    replicas) gets one ``Replicate`` over the union of its groups.
    """
    check_degrees("data_parallel", dp=dp, zero=zero)
    if dp == 1:
        return strategy
    places = [d for d in strategy.directives if isinstance(d, Place)]
    for place in places:
        if len(place.devices) != 1:
            raise DirectiveError(
                "data_parallel: the strategy is already replicated (a Place names several devices)",
                directive=str(place),
            )
    pp = max((p.devices[0] for p in places), default=-1) + 1
    out: list[Directive] = []
    # Regions (the filter without MB) -> their groups and the first Place naming them. A region
    # whose microbatches are placed on several groups (DualPipe's mirrored replicas) is
    # replicated over the union of those groups (``groups.segment_group``).
    regions: dict[Filter, tuple[list[tuple[int, ...]], Place]] = {}
    for d in strategy.directives:
        if isinstance(d, Place):
            group = tuple(d.devices[0] + j * pp for j in range(dp))
            out.append(Place(d.filter, group, d.stream, where=d.where))
            key = Filter(tuple(item for item in d.filter.items if item[0] != MB))
            regions.setdefault(key, ([], d))[0].append(group)
        elif isinstance(d, Replicate):
            raise DirectiveError("data_parallel: the strategy already has a Replicate", directive=str(d))
        else:
            out.append(d)
    replicates = [
        Replicate(key, segment_group(groups), zero, bucket_mb, where=written_at_or(first.where))
        for key, (groups, first) in regions.items()
    ]
    return Strategy([*out, *replicates])


def tensor_parallel(strategy: Strategy, tp: int, *, plan: Mapping[str, str] | None = None,
                    sp: bool = False, ep: int = 1) -> Strategy:
    """``strategy``, a pipeline program (optionally data-parallel, from ``data_parallel``),
    with every region run tensor-parallel over ``tp`` adjacent devices: device ``d`` becomes
    ``d*tp, ..., d*tp + tp - 1``, so ``Place(filter, (r,))`` becomes ``Place(filter, (r*tp,
    ..., r*tp + tp - 1))`` plus a ``Shard`` over that group (tensor parallelism innermost, as
    Megatron lays it out: its all-reduces are the most frequent traffic). A data-parallel
    group ``(d0, d1, ...)`` becomes ``(d0*tp, ..., d0*tp + tp - 1, d1*tp, ...)`` with a
    ``Shard(degree=tp)`` and its ``Replicate`` moved onto it: DP x TP. Split and Order stay.
    ``plan``: every ``Shard``'s plan by module path (``Shard``; None: found automatically).
    ``sp``: sequence parallelism between the tensor-parallel regions (``Shard``'s
    ``sequence_parallel``). ``ep``: tensor with expert parallelism, the experts split over
    ``ep`` consecutive tensor-parallel groups (``Shard.expert_degree = tp * ep``), which must be
    data-parallel replicas (``strategy`` replicated ``ep`` times, or a multiple)."""
    return _shard_every_stage(strategy, tp, ShardKind.TP, "tensor_parallel", plan=plan, sp=sp, ep=ep)


def expert_parallel(strategy: Strategy, ep: int, *, zero: int | None = None) -> Strategy:
    """``strategy``, a pipeline program (optionally data-parallel, from ``data_parallel``),
    with every region run expert-parallel over ``ep`` adjacent devices, laid out as in
    ``tensor_parallel``, with a ``Shard(kind="ep", degree=ep)``. Each expert-parallel group is
    data-parallel for the non-expert weights, and so are data-parallel replicas of it: the
    non-expert weights are reduced over the whole group (``ep * dp`` ranks), each expert's
    over the ``dp`` ranks holding it; the all-to-alls stay within ``ep`` adjacent ranks.
    ``zero`` (only for a strategy without ``Replicate``) adds one per group with that ZeRO
    level for the non-expert weights. Split and Order stay as they are."""
    return _shard_every_stage(strategy, ep, ShardKind.EP, "expert_parallel", zero=zero)


def _shard_every_stage(
    strategy: Strategy, degree: int, kind: ShardKind, name: str, *, zero: int | None = None,
    plan: Mapping[str, str] | None = None, sp: bool = False, ep: int = 1,
) -> Strategy:
    check_degrees(name, zero=zero or 0, **{str(kind.value): degree})
    if degree == 1:
        return strategy
    has_replicate = any(isinstance(d, Replicate) for d in strategy.directives)
    if zero is not None and has_replicate:
        raise DirectiveError(f"{name}: zero= is for a strategy without Replicate; this one has its own")

    def widen(devices: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(d * degree + j for d in devices for j in range(degree))

    out: list[Directive] = []
    shards: list[Shard] = []
    for d in strategy.directives:
        if isinstance(d, Place):
            group = widen(d.devices)
            out.append(Place(d.filter, group, d.stream, where=d.where))
            shards.append(Shard(d.filter, group, kind=kind, degree=degree, plan=plan,
                                sequence_parallel=sp, expert_degree=degree * ep if ep > 1 else 1,
                                where=written_at_or(d.where)))
            if zero is not None:
                out.append(Replicate(d.filter, group, zero, where=written_at_or(d.where)))
        elif isinstance(d, Replicate):
            out.append(attrs.evolve(d, devices=widen(d.devices)))
        elif isinstance(d, Shard):
            raise DirectiveError(f"{name}: the strategy already has a Shard", directive=str(d))
        else:
            out.append(d)
    return Strategy([*out, *shards])
