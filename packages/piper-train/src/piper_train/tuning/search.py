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
   rank spread over the cores if that is longer, plus the rank's tail and the driver's
   per-step cost.

``search`` ranks what fits by predicted step time (ties: less memory). It imports no torch:
the only torch-side step, rewriting sharded segments' code (which fills in which parameters
a tensor- or expert-parallel group cuts), comes in as the ``shard`` function.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import attrs

from piper_ir import Graph, PiperError, Program
from piper_memory import estimate_memory, plan_memory
from piper_scheduler import compile_program, simulate
from piper_train.tuning.costs import Profile, cost_model, segment_activation_bytes
from piper_train.tuning.space import Candidate

OK, OVER_BUDGET, INVALID = "ok", "over budget", "invalid"
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


def compile_candidate(graph: Graph, candidate: Candidate, regions: int, shard: Shard | None = None) -> Program:
    """``candidate``'s verified program for ``graph``, compiled as ``Trainer`` compiles it."""
    placed = candidate.strategy(regions).apply(graph)
    if shard is not None:
        placed = shard(placed)
    return compile_program(plan_memory(placed))


def evaluate(
    graph: Graph,
    profile: Profile,
    candidate: Candidate,
    *,
    budget_bytes: int | None = None,
    optimizer: str = "adamw",
    shard: Shard | None = None,
) -> Evaluation:
    """One candidate through the steps of the module doc."""
    if profile.batch % (candidate.microbatches * candidate.shards):
        return Evaluation(candidate, INVALID, f"a batch of {profile.batch} does not split into "
                          f"{candidate.microbatches} microbatches x {candidate.shards} shards")
    try:
        program = compile_candidate(graph, candidate, profile.regions, shard)
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
        step = max(step, profile.startup + sum(timeline.busy) / profile.cores)
    bubble = sum(timeline.idle) / (span * len(timeline.idle)) if span > 0 else 0.0
    return Evaluation(candidate, OK, predicted=step + profile.tail + profile.dispatch, makespan=span,
                      peak_bytes=peak, bubble=bubble)


def rank(evaluations: Iterable[Evaluation]) -> list[Evaluation]:
    """Fitting candidates by predicted step (then memory, then label: a stable order), then
    those over budget by memory, then the invalid ones."""
    order = {OK: 0, OVER_BUDGET: 1, INVALID: 2}

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
    progress: Callable[[Evaluation], None] | None = None,
) -> SearchResult:
    """Evaluate and rank ``candidates`` (module doc); ``progress`` hears each evaluation."""
    started = time.perf_counter()
    out = []
    for candidate in candidates:
        e = evaluate(graph, profile, candidate, budget_bytes=budget_bytes, optimizer=optimizer, shard=shard)
        out.append(e)
        if progress is not None:
            progress(e)
    return SearchResult(tuple(rank(out)), time.perf_counter() - started)
