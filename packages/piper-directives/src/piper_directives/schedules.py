"""Pipeline schedules written as directive programs (Split + Place + Order).

Every builder returns a ``Strategy``; nothing downstream knows the schedule's name. Rank
``r`` of ``pp`` holds the contiguous stages ``[r*S/pp, (r+1)*S/pp)`` of the ``S`` annotated
regions tagged ``tag``; the loss runs on the last rank, inside the last stage's slots.
"""

from __future__ import annotations

from collections.abc import Callable

from piper_directives.order import Order
from piper_directives.place import Place
from piper_directives.split import Split
from piper_directives.strategy import Strategy
from piper_ir import DirectiveError, Filter

LOSS = "loss"


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


def gpipe(pp: int, microbatches: int, *, stages: int | None = None, tag: str = "PP") -> Strategy:
    """GPipe: every rank runs all forwards, then all backwards."""
    stages = _check("gpipe", pp, microbatches, stages)
    orders = []
    for r in range(pp):
        slots = [_slot(r, pp, stages, tag, "F", i) for i in range(microbatches)]
        slots += [_slot(r, pp, stages, tag, "B", i) for i in range(microbatches)]
        orders.append(Order(slots, name=f"gpipe.rank{r}"))
    return Strategy([Split(microbatches), *_placement(pp, stages, tag), *orders])


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


SCHEDULES: dict[str, Callable[..., Strategy]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(name: str, pp: int, microbatches: int, *, stages: int | None = None, tag: str = "PP") -> Strategy:
    try:
        builder = SCHEDULES[name]
    except KeyError:
        raise DirectiveError(f"unknown schedule {name!r}; known: {', '.join(sorted(SCHEDULES))}") from None
    return builder(pp, microbatches, stages=stages, tag=tag)
