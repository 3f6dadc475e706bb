"""The search: every candidate compiled, pruned by its memory estimate, simulated, ranked.

For each ``Candidate`` (``space``), on the captured model's graph (an IR value):

1. build its directive program and compile it as ``Trainer`` does (``Strategy.apply``,
   the tensor/expert-parallel graph rewrite when a ``shard`` function is given,
   ``plan_memory``, ``compile_program``); a program that cannot be built is *invalid*,
   with the library's reason;
2. estimate every rank's memory (``piper_memory.estimate_memory`` with the profiled
   activation bytes); a rank over the budget makes it *over budget*, and it is not simulated;
3. simulate it with the profiled costs (``costs.cost_model``); the predicted step is the
   makespan, or, where more ranks share the machine than it has cores, the compute of every
   rank spread over the cores if that is longer (less the time tensor- and expert-parallel
   segments wait inside their collectives, which holds no core), plus the rank's tail and the driver's
   per-step cost.

``search`` ranks what fits by predicted step time (ties: less memory). With ``keep=K`` it
guarantees only the top K: candidates are visited by a lower bound of their predicted step
(``lower_bound``: the compute a pipeline rank must do at least, from the profile alone), and
once that bound reaches the K-th best prediction the rest cannot enter the top K and are
marked *dominated* without being compiled. It imports no torch:
the only torch-side step, rewriting sharded segments' code (which fills in which parameters
a tensor- or expert-parallel group cuts), comes in as the ``shard`` function.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Sequence

import attrs

from piper_ir import Graph, PiperError, Program
from piper_memory import estimate_memory, plan_memory
from piper_scheduler import compile_program, simulate
from piper_train.tuning.costs import Profile, cost_model, segment_activation_bytes
from piper_train.tuning.space import SPLIT_BACKWARD, Candidate

OK, OVER_BUDGET, INVALID, DOMINATED = "ok", "over budget", "invalid", "dominated"
Shard = Callable[[Graph], Graph]


@attrs.frozen
class Evaluation:
    """What the search found for one candidate. ``predicted`` is seconds per step; ``peak_bytes``
    the largest rank's estimated requirement (``MemoryEstimate.required_bytes``);
    ``bubble`` the mean idle fraction of the ranks in the simulated step."""

    candidate: Candidate
    status: str
    reason: str = ""
    predicted: float | None = None
    makespan: float | None = None
    peak_bytes: int | None = None
    bubble: float | None = None

    @property
    def fits(self) -> bool:
        return self.status == OK

    def as_dict(self) -> dict[str, object]:
        return {"strategy": self.candidate.label, **self.candidate.as_dict(), "status": self.status,
                "reason": self.reason, "predicted_seconds": self.predicted, "makespan_seconds": self.makespan,
                "peak_bytes": self.peak_bytes, "bubble_fraction": self.bubble}


@attrs.frozen
class SearchResult:
    """Every evaluation, ranked: what fits by predicted step time, then what is over budget by
    memory, then what is invalid. ``seconds``: how long the search took."""

    evaluations: tuple[Evaluation, ...]
    seconds: float

    @property
    def fitting(self) -> list[Evaluation]:
        return [e for e in self.evaluations if e.fits]

    @property
    def best(self) -> Evaluation | None:
        return next(iter(self.fitting), None)

    @property
    def smallest_requirement(self) -> Evaluation | None:
        """The candidate with the smallest estimated peak (a budget's lower bound)."""
        sized = [e for e in self.evaluations if e.peak_bytes is not None]
        return min(sized, key=lambda e: e.peak_bytes or 0, default=None)

    def count(self, status: str) -> int:
        return sum(e.status == status for e in self.evaluations)


class ShardError(PiperError):
    """The tensor/expert-parallel rewrite refused the model (no Linear pair, no expert
    module, a degree that does not divide the heads): a property of the model and the
    variant, not of the placement, so every candidate of that variant fails alike."""


def compile_candidate(graph: Graph, candidate: Candidate, regions: int, shard: Shard | None = None) -> Program:
    """``candidate``'s verified program for ``graph``, compiled as ``Trainer`` compiles it;
    ``ShardError`` when ``shard`` refuses it."""
    placed = candidate.strategy(regions).apply(graph)
    if shard is not None:
        try:
            placed = shard(placed)
        except PiperError as err:
            raise ShardError(str(err)) from err
    return compile_program(plan_memory(placed))


def evaluate(
    graph: Graph,
    profile: Profile,
    candidate: Candidate,
    *,
    budget_bytes: int | None = None,
    optimizer: str = "adamw",
    shard: Shard | None = None,
    refused: dict[str, str] | None = None,
) -> Evaluation:
    """One candidate through the steps of the module doc. ``refused`` (variant -> reason)
    remembers the variants the ``shard`` rewrite refused, which are not compiled again."""
    if profile.batch % (candidate.microbatches * candidate.shards):
        return Evaluation(candidate, INVALID, f"a batch of {profile.batch} does not split into "
                          f"{candidate.microbatches} microbatches x {candidate.shards} shards")
    if refused is not None and candidate.variant in refused:
        return Evaluation(candidate, INVALID, refused[candidate.variant])
    try:
        program = compile_candidate(graph, candidate, profile.regions, shard)
    except ShardError as err:
        reason = str(err).splitlines()[0]
        if refused is not None:
            refused[candidate.variant] = reason
        return Evaluation(candidate, INVALID, reason)
    except PiperError as err:
        return Evaluation(candidate, INVALID, str(err).splitlines()[0])
    estimates = estimate_memory(program, optimizer, activation_bytes=segment_activation_bytes(profile, candidate))
    peak = max(e.required_bytes for e in estimates.values())
    if budget_bytes is not None and peak > budget_bytes:
        worst = max(estimates.values(), key=lambda e: e.required_bytes)
        return Evaluation(candidate, OVER_BUDGET, f"rank {worst.rank} needs {peak / 2**20:.2f} MiB "
                          f"({worst.describe()})", peak_bytes=peak)
    try:
        costs = cost_model(profile, candidate)
    except KeyError:
        return Evaluation(candidate, INVALID, f"no profile for {candidate.variant} at "
                          f"{candidate.local_batch(profile.batch)} samples per microbatch", peak_bytes=peak)
    timeline = simulate(program, costs)
    span = timeline.makespan
    step = span
    if profile.cores is not None and program.world_size > profile.cores:
        step = max(step, profile.startup + sum(timeline.busy) * profile.cpu_share(candidate.variant) / profile.cores)
    bubble = sum(timeline.idle) / (span * len(timeline.idle)) if span > 0 else 0.0
    return Evaluation(candidate, OK, predicted=step + profile.tail + profile.dispatch, makespan=span,
                      peak_bytes=peak, bubble=bubble)


def lower_bound(profile: Profile, candidate: Candidate) -> float:
    """A step time ``candidate`` cannot beat, from the profile alone: the busiest pipeline
    rank does at least its share of one replica's compute (every region's forward and
    backward for every microbatch, the forward twice when recomputed, each instruction with
    its overhead, spread over ``pp`` ranks), and where ranks share fewer cores, the cores do
    every rank's compute; plus the step's fixed costs. 0 when the candidate's variant and
    size are not profiled."""
    try:
        times = profile.times(candidate.variant, candidate.local_batch(profile.batch))
    except KeyError:
        return 0.0
    split = candidate.schedule in SPLIT_BACKWARD
    per_mb = 0.0
    for segment, phases in times.items():
        backward = phases.get("B", 0.0)
        if split:  # such a schedule splits some backwards, not necessarily all: the cheaper way
            backward = min(backward if "B" in phases else float("inf"), phases.get("BI", 0.0) + phases.get("BW", 0.0))
        forward = phases.get("F", 0.0)
        again = forward if candidate.recompute and segment != "loss" else 0.0  # regions recompute, the loss not
        per_mb += forward + again + backward + 2 * profile.overhead
    work = candidate.microbatches * per_mb
    step = work / candidate.pp
    world = candidate.devices
    if profile.cores is not None and world > profile.cores:
        step = max(step, work * (world // candidate.pp) * profile.cpu_share(candidate.variant) / profile.cores)
    return profile.startup + step + profile.tail + profile.dispatch


def rank(evaluations: Iterable[Evaluation]) -> list[Evaluation]:
    """Fitting candidates by predicted step (then memory, then label: a stable order), then
    those over budget by memory, then the invalid ones."""
    order = {OK: 0, OVER_BUDGET: 1, DOMINATED: 2, INVALID: 3}

    def key(e: Evaluation) -> tuple:
        metric = e.predicted if e.status == OK else (e.peak_bytes or 0)
        return (order[e.status], metric, e.peak_bytes or 0, e.candidate.label)

    return sorted(evaluations, key=key)


def search(
    graph: Graph,
    profile: Profile,
    candidates: Sequence[Candidate],
    *,
    budget_bytes: int | None = None,
    optimizer: str = "adamw",
    shard: Shard | None = None,
    keep: int | None = None,
    progress: Callable[[Evaluation], None] | None = None,
) -> SearchResult:
    """Evaluate and rank ``candidates`` (module doc): all of them, or with ``keep=K`` enough
    to rank the best K exactly; ``progress`` hears each evaluation."""
    started = time.perf_counter()
    out = []
    refused: dict[str, str] = {}
    order = sorted(candidates, key=lambda c: lower_bound(profile, c)) if keep else list(candidates)
    best: list[float] = []  # the K best predictions so far, ascending
    for candidate in order:
        bound = lower_bound(profile, candidate) if keep else 0.0
        if keep and len(best) >= keep and bound >= best[keep - 1]:
            e = Evaluation(candidate, DOMINATED, f"cannot enter the top {keep}: at least {bound * 1e3:.2f} ms")
        else:
            e = evaluate(graph, profile, candidate, budget_bytes=budget_bytes, optimizer=optimizer, shard=shard,
                         refused=refused)
            if e.status == OK and e.predicted is not None:
                bisect.insort(best, e.predicted)
        out.append(e)
        if progress is not None:
            progress(e)
    return SearchResult(tuple(rank(out)), time.perf_counter() - started)
