"""Pipeline schedules written as directive programs (Split + Place + Order).

Every builder returns a ``Strategy``; nothing downstream knows the schedule's name.

- ``gpipe``, ``1f1b``, ``zb1p``: rank ``r`` of ``pp`` holds the contiguous stages
  ``[r*S/pp, (r+1)*S/pp)`` of the ``S`` annotated regions tagged ``tag``; the loss runs on
  the last rank, inside the last stage's slots.
- ``interleaved_1f1b``: rank r holds regions ``r, r + pp, ...`` (virtual stages).
- ``dualpipev``: ``2 * pp`` stages in a V, rank r holds stages r and ``2pp - 1 - r``.
- ``dualpipe``: ``pp`` stages run in both directions, rank r holds stages r and ``pp - 1 - r``
  (mirrored replicas: microbatches placed by direction, gradients summed over the pair).

``zb1p``, ``dualpipe`` and ``dualpipev`` name BI/BW passes in their orders, which splits those chunks'
backward (``split_backward``). ``docs/schedules.md`` writes a schedule from scratch.

Every builder writes the pipeline-only program and takes ``dp``, ``zero``, ``tp`` and ``ep``,
which ``parallelize`` applies on top (pipeline rank r of replica j on device ``r + j * pp``,
each widened to ``tp`` or ``ep`` adjacent devices), so each schedule composes with data,
tensor and expert parallelism and ZeRO without code of its own.
"""

from __future__ import annotations

import functools
from collections import defaultdict, deque
from collections.abc import Callable

from piper_directives.order import Order
from piper_directives.parallelize import parallelize
from piper_directives.place import Place
from piper_directives.split import Split
from piper_directives.strategy import Strategy
from piper_ir import DirectiveError, Filter

LOSS = "loss"


def _composes(builder: Callable[..., Strategy]) -> Callable[..., Strategy]:
    """Give the pipeline-only ``builder`` the keywords ``dp``, ``zero``, ``tp`` and ``ep``
    (``parallelize``)."""

    @functools.wraps(builder)
    def build(
        pp: int, microbatches: int, *, dp: int = 1, zero: int = 0, tp: int = 1, ep: int = 1, **kwargs: object
    ) -> Strategy:
        return parallelize(builder(pp, microbatches, **kwargs), dp=dp, zero=zero, tp=tp, ep=ep)

    return build


def _check(name: str, pp: int, microbatches: int, stages: int | None) -> int:
    for what, v in (("pp", pp), ("microbatches", microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DirectiveError(f"{name}: {what} must be a positive int, got {v!r}")
    stages = pp if stages is None else stages
    if stages < pp or stages % pp:
        raise DirectiveError(f"{name}: {stages} stages cannot be spread evenly over {pp} pipeline ranks")
    return stages


def _rank_stages(rank: int, pp: int, stages: int) -> range:
    per = stages // pp
    return range(rank * per, (rank + 1) * per)


def _placement(pp: int, stages: int, tag: str) -> list[Place]:
    return [Place(Filter.of({tag: s}), (r,)) for r in range(pp) for s in _rank_stages(r, pp, stages)]


def _slot(rank: int, pp: int, stages: int, tag: str, phase: str, mb: int) -> list[Filter]:
    slot = [Filter.of({tag: s, "PASS": phase, "MB": mb}) for s in _rank_stages(rank, pp, stages)]
    if rank == pp - 1:
        slot.append(Filter.of({"SEG": LOSS, "PASS": phase, "MB": mb}))
    return slot


@_composes
def gpipe(pp: int, microbatches: int, *, stages: int | None = None, tag: str = "PP") -> Strategy:
    """GPipe: every rank runs all forwards, then all backwards."""
    stages = _check("gpipe", pp, microbatches, stages)
    orders = []
    for r in range(pp):
        slots = [_slot(r, pp, stages, tag, "F", i) for i in range(microbatches)]
        slots += [_slot(r, pp, stages, tag, "B", i) for i in range(microbatches)]
        orders.append(Order(slots, name=f"gpipe.rank{r}"))
    return Strategy([Split(microbatches), *_placement(pp, stages, tag), *orders])


@_composes
def one_f_one_b(pp: int, microbatches: int, *, stages: int | None = None, tag: str = "PP") -> Strategy:
    """1F1B: ``pp - r - 1`` warm-up forwards on rank r, then one forward, one backward."""
    stages = _check("1f1b", pp, microbatches, stages)
    orders = []
    for r in range(pp):
        warmup = min(pp - r - 1, microbatches)
        slots = [_slot(r, pp, stages, tag, "F", i) for i in range(warmup)]
        for i in range(warmup, microbatches):
            slots.append(_slot(r, pp, stages, tag, "F", i))
            slots.append(_slot(r, pp, stages, tag, "B", i - warmup))
        slots += [_slot(r, pp, stages, tag, "B", i) for i in range(microbatches - warmup, microbatches)]
        orders.append(Order(slots, name=f"1f1b.rank{r}"))
    return Strategy([Split(microbatches), *_placement(pp, stages, tag), *orders])


# -- schedules with several stages per rank and split backward ---------------------------------
#
# The builders below compute, per rank, a list of *slots* of *actions*. An action is
# ``(stage, pass, microbatch)`` with pass F, B, BI or BW; a slot holding two actions is an
# overlapped pair (DualPipe's F&B). A "stage" here is a schedule stage: a contiguous group of
# ``regions // n_stages`` annotated regions. ``strategy_from_slots`` turns the lists into
# Split + Place + Order; naming BI/BW in an Order is what splits a chunk's backward.

Action = tuple[int, str, int]
Slot = tuple[Action, ...]


def strategy_from_slots(
    name: str,
    microbatches: int,
    regions: int,
    stage_rank: list[int],
    rank_slots: list[list[Slot]],
    tag: str,
) -> Strategy:
    """Split + Place + Order from per-rank slots: schedule stage ``k`` (``regions /
    len(stage_rank)`` contiguous regions) on rank ``stage_rank[k]``, one ``Order`` per rank
    named ``<name>.rank<r>``. ``torch_format`` builds strategies from torch's CSV with it."""
    per = regions // len(stage_rank)
    places = [Place(Filter.of({tag: j}), (stage_rank[j // per],)) for j in range(regions)]
    orders = _orders(name, len(stage_rank), per, rank_slots, tag)
    return Strategy([Split(microbatches), *places, *orders])


def _orders(name: str, n_stages: int, per: int, rank_slots: list[list[Slot]], tag: str) -> list[Order]:
    """One ``Order`` per rank; schedule stage k is regions ``[k * per, (k + 1) * per)``."""
    orders = []
    for r, slots in enumerate(rank_slots):
        order_slots = []
        for slot in slots:
            filters = []
            for stage, phase, mb in slot:
                filters += [Filter.of({tag: j, "PASS": phase, "MB": mb}) for j in range(stage * per, (stage + 1) * per)]
                # The loss (no parameters, never split) runs with the last stage: its forward
                # after the stage's forward, its backward before the stage's B or BI.
                if stage == n_stages - 1 and phase != "BW":
                    filters.append(Filter.of({"SEG": LOSS, "PASS": "F" if phase == "F" else "B", "MB": mb}))
            order_slots.append(filters)
        orders.append(Order(order_slots, name=f"{name}.rank{r}"))
    return orders


def _positive(name: str, **values: object) -> None:
    for what, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DirectiveError(f"{name}: {what} must be a positive int, got {v!r}")


def _one_f_one_b_actions(
    rank: int, pp: int, v: int, microbatches: int, *, zero_bubble: bool
) -> list[Slot]:
    """torch.distributed.pipelining's ``_get_1f1b_rank_ops`` (Interleaved1F1B and, with
    ``zero_bubble``, InterleavedZeroBubble), without its no-op padding.

    Rank ``rank`` holds stages ``rank, rank + pp, ...``; forwards walk them in rounds of
    ``per_round`` microbatches, backwards walk them in reverse. With ``zero_bubble`` each
    backward is split and rank r delays its weight passes by r steps (ZB-H1), then drains them.
    """
    rounds = max(1, microbatches // pp)
    per_round = microbatches // rounds
    factor = 1 if zero_bubble else 2
    warmup = min((v - 1) * per_round + factor * (pp - 1 - rank), microbatches * v)
    fwd_bwd = microbatches * v - warmup
    next_mb: dict[tuple[int, str], int] = defaultdict(int)

    def take(stage: int, phase: str) -> Action:
        mb = next_mb[(stage, phase)]
        next_mb[(stage, phase)] += 1
        return (stage, phase, mb)

    def f_stage(op: int) -> int:
        return ((op // per_round) % v) * pp + rank

    def b_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * pp + rank

    slots: list[Slot] = []
    weights: deque[Action] = deque()
    for op in range(warmup + fwd_bwd + warmup):
        if op < warmup + fwd_bwd:
            slots.append((take(f_stage(op), "F"),))
        if op < warmup:
            continue
        stage, _, mb = take(b_stage(op), "BI" if zero_bubble else "B")
        slots.append(((stage, "BI" if zero_bubble else "B", mb),))
        if zero_bubble:
            weights.append((stage, "BW", mb))
            if op - warmup >= rank:
                slots.append((weights.popleft(),))
    slots.extend((w,) for w in weights)
    return slots


@_composes
def interleaved_1f1b(pp: int, microbatches: int, *, stages: int | None = None, tag: str = "PP") -> Strategy:
    """Interleaved 1F1B (Narayanan et al. 2021, as torch's ``ScheduleInterleaved1F1B``).

    ``stages`` annotated regions (default ``2 * pp``) are ``v = stages / pp`` virtual stages
    per rank: rank r holds regions ``r, r + pp, r + 2pp, ...``. Microbatches go in rounds of
    ``microbatches / max(1, microbatches // pp)``, which must be a whole number.
    """
    _positive("interleaved_1f1b", pp=pp, microbatches=microbatches)
    stages = 2 * pp if stages is None else stages
    _positive("interleaved_1f1b", stages=stages)
    if stages % pp:
        raise DirectiveError(
            f"interleaved_1f1b: {stages} annotated regions cannot be dealt round-robin over {pp} ranks "
            f"(need a multiple of {pp}: each rank holds stages r, r+{pp}, ...)"
        )
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        raise DirectiveError(
            f"interleaved_1f1b: {microbatches} microbatches cannot be run in {rounds} equal rounds "
            f"(rounds = max(1, microbatches // pp)); use a multiple of {pp} or fewer than {2 * pp}"
        )
    v = stages // pp
    slots = [_one_f_one_b_actions(r, pp, v, microbatches, zero_bubble=False) for r in range(pp)]
    return strategy_from_slots("interleaved_1f1b", microbatches, stages, [k % pp for k in range(stages)], slots, tag)


@_composes
def zb1p(pp: int, microbatches: int, *, stages: int | None = None, tag: str = "PP") -> Strategy:
    """ZB-H1 zero bubble (Qi et al. 2024; torch's ``ScheduleInterleavedZeroBubble`` with one
    stage per rank): 1F1B with every backward split into BI and BW; rank r postpones r of
    its BW passes so they fill the cool-down bubble. Needs ``microbatches >= pp``.

    Rank r holds the contiguous regions ``[r * stages / pp, (r + 1) * stages / pp)``.
    """
    _positive("zb1p", pp=pp, microbatches=microbatches)
    stages = _check("zb1p", pp, microbatches, stages)
    if microbatches < pp:
        raise DirectiveError(f"zb1p: ZB-H1 needs at least as many microbatches as ranks, got {microbatches} for pp={pp}")
    slots = [_one_f_one_b_actions(r, pp, 1, microbatches, zero_bubble=True) for r in range(pp)]
    return strategy_from_slots("zb1p", microbatches, stages, list(range(pp)), slots, tag)


def _dualpipev_actions(rank: int, pp: int, microbatches: int) -> list[Slot]:
    """One rank of DeepSeek's DualPipeV (``dualpipev.py``, as ported to torch's
    ``ScheduleDualPipeV``): eight phases; ``(F, B)`` pairs share a slot (overlapped); a
    backward "with zero bubble" is BI now and BW later, weight passes run oldest first."""
    s0, s1 = rank, 2 * pp - 1 - rank
    next_mb: dict[tuple[int, str], int] = defaultdict(int)
    weights: deque[Action] = deque()
    slots: list[Slot] = []

    def take(stage: int, phase: str) -> Action:
        key = (stage, "F" if phase == "F" else "B")  # B and BI share one counter per stage
        mb = next_mb[key]
        next_mb[key] += 1
        if phase == "BI":
            weights.append((stage, "BW", mb))
        return (stage, phase, mb)

    def add(stage: int, phase: str) -> None:
        slots.append((take(stage, phase),))

    def overlap(f_stage: int, b_stage: int) -> None:
        slots.append((take(f_stage, "F"), take(b_stage, "B")))

    def weight() -> None:
        if weights:
            slots.append((weights.popleft(),))

    for _ in range((pp - rank - 1) * 2):  # 1: F0
        add(s0, "F")
    for _ in range(rank + 1):  # 2: F0 F1
        add(s0, "F")
        add(s1, "F")
    for _ in range(pp - rank - 1):  # 3: I1 W F1
        add(s1, "BI")
        weight()
        add(s1, "F")
    for i in range(microbatches - 2 * pp + rank + 1):  # 4 (main): F0&B1, F1&B0
        if i == 0 and rank == pp - 1:
            # DualPipe does not overlap this first pair, to shrink the bubble.
            add(s0, "F")
            add(s1, "B")
        else:
            overlap(s0, s1)
        overlap(s1, s0)
    for _ in range(pp - rank - 1):  # 5: B1, F1&B0
        add(s1, "B")
        overlap(s1, s0)
    zero_bubble = False
    for i in range(rank + 1):  # 6: B1 B0, the second half with zero bubble
        if i == (rank + 1) // 2 and rank % 2 == 1:
            zero_bubble = True
        add(s1, "BI" if zero_bubble else "B")
        if i == (rank + 1) // 2 and rank % 2 == 0:
            zero_bubble = True
        add(s0, "BI" if zero_bubble else "B")
    for _ in range(pp - rank - 1):  # 7: W B0
        weight()
        add(s0, "BI" if zero_bubble else "B")
    for _ in range(rank + 1):  # 8: W
        weight()
    if weights:  # every weight pass must have been placed
        raise AssertionError(f"dualpipev rank {rank}: {len(weights)} weight passes left over")
    return slots


@_composes
def dualpipev(pp: int, microbatches: int, *, stages: int | None = None, tag: str = "PP") -> Strategy:
    """DualPipeV (DeepSeek; the "cut-in-half" DualPipe): ``2 * pp`` schedule stages in a V,
    rank r holding stages r and ``2pp - 1 - r`` (the loss ends up on rank 0), overlapped
    forward/backward pairs in the steady state and zero-bubble weight passes at the ends.

    ``stages`` annotated regions (default ``2 * pp``) must be a multiple of ``2 * pp``; each
    schedule stage is a contiguous group of them. Needs ``microbatches >= 2 * pp``.
    """
    _positive("dualpipev", pp=pp, microbatches=microbatches)
    stages = 2 * pp if stages is None else stages
    _positive("dualpipev", stages=stages)
    if stages % (2 * pp):
        raise DirectiveError(
            f"dualpipev: {stages} annotated regions cannot form the {2 * pp} stages of a V over {pp} ranks "
            f"(need a multiple of {2 * pp})"
        )
    if microbatches < 2 * pp:
        raise DirectiveError(
            f"dualpipev: needs at least 2 * pp = {2 * pp} microbatches, got {microbatches}"
        )
    stage_rank = [min(k, 2 * pp - 1 - k) for k in range(2 * pp)]
    slots = [_dualpipev_actions(r, pp, microbatches) for r in range(pp)]
    return strategy_from_slots("dualpipev", microbatches, stages, stage_rank, slots, tag)


def _dualpipe_actions(rank: int, pp: int, microbatches: int) -> list[Slot]:
    """One rank of DeepSeek's DualPipe (``dualpipe.py``).

    Rank r runs stage r of direction 0 (microbatches ``0 .. M/2 - 1``, entering at rank 0) and
    stage ``pp - 1 - r`` of direction 1 (microbatches ``M/2 .. M - 1``, entering at rank
    ``pp - 1``). DeepSeek's per-rank program depends only on the half rank
    ``h = min(r, pp - 1 - r)``: its "phase 0" chunk is the stage of the direction entering at
    the rank's own end (stage h), its "phase 1" chunk the other (stage ``pp - 1 - h``), each
    fed M/2 microbatches, and the eight phases are exactly DualPipeV's for rank h of
    ``pp / 2`` ranks (``dualpipev.py`` is DualPipe cut in half). So rank r replays
    ``_dualpipev_actions(h, pp / 2, M / 2)`` with each chunk's microbatches renumbered into
    its direction's half; ranks r and ``pp - 1 - r`` run mirrored programs.
    """
    h, half = min(rank, pp - 1 - rank), microbatches // 2
    near = 0 if rank < pp // 2 else 1  # the direction that enters at this rank's end

    def number(stage: int, mb: int) -> int:
        direction = near if stage == h else 1 - near
        return mb + direction * half

    return [
        tuple((stage, phase, number(stage, mb)) for stage, phase, mb in slot)
        for slot in _dualpipev_actions(h, pp // 2, half)
    ]


@_composes
def dualpipe(pp: int, microbatches: int, *, stages: int | None = None, tag: str = "PP") -> Strategy:
    """DualPipe (DeepSeek-V3, bidirectional): the first half of the microbatches runs stages
    ``0 .. pp-1`` on ranks ``0 .. pp-1``, the second half runs them on ranks ``pp-1 .. 0``, so
    rank r holds stage r and stage ``pp - 1 - r``; overlapped forward/backward pairs in the
    steady state, zero-bubble weight passes at the ends (``_dualpipe_actions``).

    Each stage thus has two *mirrored replicas* (ranks s and ``pp - 1 - s``): its
    microbatches are placed by direction (``Place`` with an ``MB`` set), its parameters live on
    both ranks, and their gradients are summed over the pair (an all-reduce, no batch
    sharding) before both ranks take the same optimizer step. ``stages`` annotated regions
    (default ``pp``) must be a multiple of ``pp``; each stage is a contiguous group of them.
    Needs an even ``pp`` and an even number of microbatches, at least ``2 * pp``. With ``dp``
    replicas the mirror pair times the data-parallel group keeps one segment's parameters in
    sync: ZeRO 0 and 1 reduce over all ``2 * dp`` devices once per step; ZeRO 2 and 3 shard
    over each direction's ``dp`` ranks (per-microbatch reduce-scatters and parameter gathers
    stay inside one direction) and the two mirror ranks holding one shard range sum its
    gradient before both step it (``replicate.mirrored_buckets``).
    """
    _positive("dualpipe", pp=pp, microbatches=microbatches)
    if pp % 2:
        raise DirectiveError(f"dualpipe: needs an even number of ranks, got pp={pp}")
    if microbatches % 2 or microbatches < 2 * pp:
        raise DirectiveError(
            f"dualpipe: needs an even number of microbatches, at least 2 * pp = {2 * pp}; got {microbatches}"
        )
    stages = pp if stages is None else stages
    _positive("dualpipe", stages=stages)
    if stages % pp:
        raise DirectiveError(
            f"dualpipe: {stages} annotated regions cannot form {pp} stages (need a multiple of {pp})"
        )
    per, half = stages // pp, microbatches // 2
    directions = (tuple(range(half)), tuple(range(half, microbatches)))
    places = [
        Place(Filter.of({tag: j, "MB": directions[d]}), (j // per if d == 0 else pp - 1 - j // per,))
        for j in range(stages)
        for d in (0, 1)
    ]
    orders = _orders("dualpipe", pp, per, [_dualpipe_actions(r, pp, microbatches) for r in range(pp)], tag)
    return Strategy([Split(microbatches), *places, *orders])


SCHEDULES: dict[str, Callable[..., Strategy]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb1p": zb1p,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
}


def build_schedule(
    name: str,
    pp: int,
    microbatches: int,
    *,
    stages: int | None = None,
    tag: str = "PP",
    dp: int = 1,
    zero: int = 0,
    tp: int = 1,
    ep: int = 1,
) -> Strategy:
    """The library schedule ``name`` over ``pp`` pipeline ranks, replicated ``dp`` times with
    ZeRO level ``zero``, each stage tensor-parallel over ``tp`` or expert-parallel over ``ep``
    devices (``parallelize``: stage r of replica j on ``(r + j * pp) * k + t``)."""
    try:
        builder = SCHEDULES[name]
    except KeyError:
        raise DirectiveError(f"unknown schedule {name!r}; known: {', '.join(sorted(SCHEDULES))}") from None
    return parallelize(builder(pp, microbatches, stages=stages, tag=tag), dp=dp, zero=zero, tp=tp, ep=ep)


_TORCH_LETTER = {"F": "F", "B": "B", "BI": "I", "BW": "W"}


def rank_actions(order: Order, tag: str = "PP", *, regions_per_stage: int = 1) -> list[str]:
    """An ``Order``'s slots as torch.distributed.pipelining action strings: ``2F0`` (stage 2
    forward of microbatch 0), ``1I3``/``1W3`` (split backward), ``(0F7;7B3)`` (an overlapped
    slot). The loss is left out; a stage is ``region // regions_per_stage``."""
    out = []
    for slot in order.slots:
        seen: list[str] = []
        for flt in slot:
            keys = flt.as_dict()
            if tag not in keys:
                continue
            text = f"{int(keys[tag]) // regions_per_stage}{_TORCH_LETTER[str(keys['PASS'])]}{keys['MB']}"
            if text not in seen:
                seen.append(text)
        if seen:
            out.append(seen[0] if len(seen) == 1 else "(" + ";".join(seen) + ")")
    return out
