"""The strategy space ``piper tune`` searches, and each point of it as a directive program.

A ``Candidate`` is one point: a library schedule over ``pp`` pipeline ranks, ``dp``
data-parallel replicas, tensor- or expert-parallel degree ``tp``/``ep`` (with ``sp``: tensor
parallelism with sequence parallelism between its regions), context-parallel degree ``cp``
(every sequence cut over ``cp`` adjacent ranks; not with tp/ep, which the library refuses), a
ZeRO level, a microbatch count, where the schedule's stages begin among the model's annotated regions
(``bounds``), and whether every region recomputes its activations in its backward
(``recompute``: less memory, one more forward per microbatch; not with tp/ep/cp, which the
library refuses). ``Candidate.strategy(regions)`` is its program: the schedule built over one
region per schedule stage (``build_schedule(..., stages=chunks)``), every ``PP`` filter
widened to the stage's regions (``rebound``), then ``parallelize`` (``context_parallel`` for cp) and, when it recomputes, a ``Recompute`` of every region
— the same composition ``piper train`` uses, so the JSON ``piper tune --out`` writes is what ``piper train --strategy``
runs.

``enumerate_space`` lists the candidates for a device count: every factorisation
``pp * dp * k`` (k = tp, ep or cp; each cp degree asked for, each tp > 1 without and,
when asked, with sp), every ZeRO level that applies, every schedule and microbatch
count, and for each the even split of the regions and, given region weights, the balanced
one (uneven regions, e.g. an embedding or an LM head, make the even split lopsided), each
without and (given ``recompute=(False, True)``) with recomputation.
Candidates that cannot be built (a batch that does not divide, a schedule's own limits) are
kept, with the reason, so the table can say why they were left out.

Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from piper_directives import (
    SCHEDULES,
    DegreeError,
    Order,
    Place,
    Recompute,
    Strategy,
    build_schedule,
    check_degrees,
    context_parallel,
    parallelize,
)
from piper_ir import DirectiveError, Filter

#: Schedule stages per pipeline rank (virtual stages for interleaved 1F1B and DualPipeV).
CHUNKS_PER_RANK = {"gpipe": 1, "1f1b": 1, "zb1p": 1, "dualpipe": 1, "interleaved_1f1b": 2, "dualpipev": 2}
#: Schedules whose orders split the backward into BI and BW (their profile needs both halves).
SPLIT_BACKWARD = frozenset({"zb1p", "dualpipe", "dualpipev"})


@attrs.frozen
class Candidate:
    """One strategy of the search (module doc). ``bounds`` lists the first region of every
    schedule stage and, last, the region count; ``None`` spreads the regions evenly."""

    schedule: str
    pp: int
    microbatches: int
    dp: int = 1
    tp: int = 1
    ep: int = 1
    zero: int = 0
    bounds: tuple[int, ...] | None = None
    recompute: bool = False
    sp: bool = False  # sequence parallelism between the tensor-parallel regions (tp >= 2)
    cp: int = 1  # context-parallel ranks per stage and replica (each sequence cut cp ways)

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.tp * self.ep * self.cp

    @property
    def chunks(self) -> int:
        """Schedule stages (one or two per pipeline rank)."""
        return self.pp * CHUNKS_PER_RANK[self.schedule]

    @property
    def variant(self) -> str:
        """How each region runs, which decides its compute time (and what it keeps): ``none``,
        ``tpK``, ``tpKsp`` (with sequence parallelism), ``epK`` or ``cpK``."""
        if self.tp > 1:
            return f"tp{self.tp}sp" if self.sp else f"tp{self.tp}"
        return f"ep{self.ep}" if self.ep > 1 else f"cp{self.cp}" if self.cp > 1 else "none"

    @property
    def shards(self) -> int:
        """Ways the batch is cut besides microbatches: data-parallel replicas and, for expert
        parallelism, the ranks of each group (each sees its own tokens)."""
        return self.dp * self.ep

    def local_batch(self, batch: int) -> int:
        """Samples one rank's forward of one microbatch sees."""
        return batch // (self.microbatches * self.shards)

    @property
    def label(self) -> str:
        parts = [self.schedule, f"pp={self.pp}"]
        parts += [f"{k}={v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("ep", self.ep), ("cp", self.cp)) if v > 1]
        if self.sp:
            parts.append("sp")
        if self.zero:
            parts.append(f"zero={self.zero}")
        parts.append(f"mb={self.microbatches}")
        if self.bounds is not None:
            parts.append("stages=" + "|".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}"
                                               for a, b in zip(self.bounds, self.bounds[1:], strict=False)))
        if self.recompute:
            parts.append("recompute")
        return " ".join(parts)

    def as_dict(self) -> dict[str, object]:
        return {**attrs.asdict(self), "bounds": list(self.bounds) if self.bounds is not None else None}

    def strategy(self, regions: int, tag: str = "PP") -> Strategy:
        """The directive program (module doc); ``DirectiveError`` when it cannot be built."""
        chunks = self.chunks
        bounds = self.bounds if self.bounds is not None else even_bounds(regions, chunks)
        if bounds is None:
            raise DirectiveError(f"{self.schedule}: {regions} regions cannot be spread evenly over {chunks} "
                                 f"schedule stages ({CHUNKS_PER_RANK[self.schedule]} per pipeline rank)")
        if (len(bounds) != chunks + 1 or bounds[0] != 0 or bounds[-1] != regions
                or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False))):
            raise DirectiveError(f"{self.schedule}: stage bounds {list(bounds)} do not cut {regions} regions "
                                 f"into {chunks} non-empty stages")
        pipeline = rebound(build_schedule(self.schedule, self.pp, self.microbatches, stages=chunks, tag=tag),
                           bounds, tag)
        strategy = parallelize(pipeline, dp=self.dp, zero=self.zero, tp=self.tp, ep=self.ep, sp=self.sp)
        strategy = context_parallel(strategy, self.cp)
        return Strategy([*strategy.directives, Recompute({})]) if self.recompute else strategy


def variant_degrees(variant: str) -> tuple[int, int, int, bool]:
    """``(tp, ep, cp, sp)`` of a variant name (``Candidate.variant``: ``none``, ``tpK``,
    ``tpKsp``, ``epK``, ``cpK``)."""
    if variant == "none":
        return 1, 1, 1, False
    kind, sp = variant[:2], variant.endswith("sp")
    degree = int(variant[2:-2] if sp else variant[2:])
    return (degree if kind == "tp" else 1, degree if kind == "ep" else 1, degree if kind == "cp" else 1, sp)


def rebound(strategy: Strategy, bounds: Sequence[int], tag: str = "PP") -> Strategy:
    """``strategy``, written for one region per schedule stage, with stage ``k`` widened to
    regions ``bounds[k] .. bounds[k+1] - 1``: each ``Place`` becomes one per region, and each
    filter in an ``Order`` slot one per region, as the schedule library writes several regions
    per stage."""

    def widen(f: Filter) -> list[Filter]:
        items = f.as_dict()
        stage = items.get(tag)
        if not isinstance(stage, int):
            return [f]
        return [Filter.of({**items, tag: j}) for j in range(bounds[stage], bounds[stage + 1])]

    out: list[object] = []
    for d in strategy.directives:
        if isinstance(d, Place):
            out.extend(attrs.evolve(d, filter=f) for f in widen(d.filter))
        elif isinstance(d, Order):
            out.append(attrs.evolve(d, slots=[[g for f in slot for g in widen(f)] for slot in d.slots]))
        else:
            out.append(d)
    return Strategy(out)


def even_bounds(regions: int, chunks: int) -> tuple[int, ...] | None:
    """The even split, or ``None`` when ``chunks`` does not divide ``regions``."""
    if chunks > regions or regions % chunks:
        return None
    per = regions // chunks
    return tuple(range(0, regions + 1, per))


def balanced_bounds(weights: Sequence[float], chunks: int) -> tuple[int, ...] | None:
    """Contiguous stages minimising the heaviest stage's weight (a linear partition, by
    dynamic programming over prefix sums); ``None`` with fewer regions than stages. Ties go
    to the split whose earlier stages are longer, like ``models._group``."""
    n = len(weights)
    if chunks > n or chunks < 1:
        return None
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the heaviest stage when the first i regions form k stages; cut[k][i]: start of the k-th
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            for j in range(i - 1, k - 2, -1):  # last stage = regions j .. i-1; larger stages first
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(chunks, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return tuple(reversed(bounds))


def factorizations(
    devices: int, kinds: Iterable[str] = ("tp", "ep"), pps: Iterable[int] | None = None
) -> list[tuple[int, int, int, int]]:
    """Every ``(pp, dp, tp, ep)`` whose product is ``devices``, with at most one of tp, ep > 1
    (and pp among ``pps`` when given)."""
    out = []
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    allowed = set(divisors if pps is None else pps)
    for k in divisors:
        for pp in divisors:
            if (devices // k) % pp or pp not in allowed:
                continue
            dp = devices // (k * pp)
            if k == 1:
                out.append((pp, dp, 1, 1))
                continue
            if "tp" in kinds:
                out.append((pp, dp, k, 1))
            if "ep" in kinds:
                out.append((pp, dp, 1, k))
    return out


def enumerate_space(
    devices: int,
    regions: int,
    *,
    microbatches: Iterable[int],
    schedules: Iterable[str] = tuple(SCHEDULES),
    zeros: Iterable[int] = (0, 1, 2, 3),
    kinds: Iterable[str] = ("tp", "ep"),
    weights: Sequence[float] | None = None,
    pps: Iterable[int] | None = None,
    recompute: Iterable[bool] = (False,),
    sp: Iterable[bool] = (False,),
    cps: Iterable[int] = (1,),
) -> list[Candidate]:
    """The candidates for ``devices`` devices and a model of ``regions`` regions (module
    doc). ``weights``, one per region (e.g. profiled forward + backward time), adds the
    balanced split where it differs from the even one. A ZeRO level above 0 needs a group
    to shard over (dp > 1, or ep > 1, whose group is data-parallel for the non-expert
    weights). ``recompute`` lists the choices tried (recomputing only without tp/ep/cp);
    ``sp`` the sequence-parallel choices of each candidate with tp > 1; ``cps`` the
    context-parallel degrees (each dividing ``devices``; cp > 1 without tp or ep: pp x dp x cp)."""
    recomputes = sorted(set(recompute))
    microbatches, zeros, schedules, kinds = sorted(set(microbatches)), sorted(set(zeros)), list(schedules), tuple(kinds)
    sps = sorted(set(sp))
    out: list[Candidate] = []
    shapes = [(pp, dp, tp, ep, 1) for pp, dp, tp, ep in factorizations(devices, kinds, pps)] if 1 in set(cps) else []
    for cp in sorted(c for c in set(cps) if c > 1 and devices % c == 0):
        shapes += [(pp, dp, 1, 1, cp) for pp, dp, _, _ in factorizations(devices // cp, (), pps)]
    for pp, dp, tp, ep, cp in shapes:
        for zero in zeros:
            try:  # piper-directives' rule: ZeRO needs replicas to shard over (dp or ep >= 2)
                check_degrees(dp=dp, zero=zero, tp=tp, ep=ep)
            except DegreeError:
                continue
            for schedule in schedules:
                chunks = pp * CHUNKS_PER_RANK[schedule]
                layouts: list[tuple[int, ...] | None] = []
                even = even_bounds(regions, chunks)
                if even is not None:
                    layouts.append(None)
                balanced = balanced_bounds(weights, chunks) if weights is not None else None
                if balanced is not None and balanced != even:
                    layouts.append(balanced)
                if not layouts:
                    layouts.append(None)  # refused later, with the library's reason
                for m in microbatches:
                    out.extend(Candidate(schedule, pp, m, dp, tp, ep, zero, b, r, s, cp) for r in recomputes
                               if not (r and (tp > 1 or ep > 1 or cp > 1)) for b in layouts
                               for s in (sps if tp > 1 else (False,)))
    return out
