"""``piper_train.tune``: profile a model, search the strategy space, and optionally prove
the winners on the runtime (``validate``).

The steps, and which module does each: capture the model (``piper_directives.capture``);
enumerate the candidates (``space``); drop those that cannot be built before measuring
anything (a batch that does not divide, a schedule's limits), then measure what the rest need
(``profiler``: the region times of each variant and microbatch size, cached); compile,
estimate, simulate and rank every candidate (``search``). ``TuneReport`` holds the result;
``TuneReport.write`` saves the best strategy as a directive program that ``piper train
--strategy`` runs.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import ray

from piper_directives import (
    SCHEDULES,
    CapturedModel,
    capture,
    context_modules,
    shard_modules,
    sharded_buckets,
)
from piper_ir import ClusterError, Graph, MemoryPlanError, PiperError, ShardKind
from piper_runtime import OptimizerSpec, ensure_ray
from piper_train.models import ModelSpec
from piper_train.trainer import Trainer
from piper_train.tuning.costs import Profile
from piper_train.tuning.profiler import DEFAULT_CACHE, Profiler, usable_cores
from piper_train.tuning.search import Evaluation, SearchResult, search
from piper_train.tuning.space import SPLIT_BACKWARD, Candidate, enumerate_space
from piper_train.workload import load_workload

Log = Callable[[str], None]


@attrs.frozen
class TuneReport:
    """What ``tune`` found: the ranked ``result``, the ``profile`` it used, the search space
    size and how long each part took."""

    model: str
    devices: int
    regions: int
    result: SearchResult
    profile: Profile
    space: int
    profile_seconds: float
    budget_bytes: int | None = None
    profile_runs: int = 0  # measurements this call made (0: all from the cache)

    @property
    def best(self) -> Evaluation | None:
        return self.result.best

    def document(self, evaluation: Evaluation | None = None) -> dict[str, object]:
        """The directive program of ``evaluation`` (default: the best) as a JSON object, with
        what the search said about it under ``"tune"`` (``Strategy.from_json`` reads only
        ``"directives"``)."""
        e = evaluation or self.best
        if e is None:
            raise MemoryPlanError("no candidate fits")
        doc = json.loads(e.candidate.strategy(self.regions).to_json())
        doc["tune"] = {"model": self.model, "devices": self.devices, "regions": self.regions, **e.as_dict()}
        return doc

    def write(self, path: Path, evaluation: Evaluation | None = None) -> None:
        path.write_text(json.dumps(self.document(evaluation), indent=1) + "\n")


def check_devices(devices: int, address: str | None) -> None:
    """``ClusterError`` when the Ray cluster has fewer CPUs than ``devices`` ranks need (one
    each, as ``Runtime`` reserves); an embedded cluster is started with enough."""
    ensure_ray(address, num_cpus=max(usable_cores(), devices))
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if cpus + 1e-9 < devices:
        raise ClusterError(f"--devices {devices}: the Ray cluster has {cpus:g} CPUs, and each of the {devices} "
                           "ranks needs one; tune for fewer devices or add CPUs or nodes to the cluster")


def _needs(candidates: Iterable[Candidate], batch: int) -> list[tuple[str, int, bool]]:
    """The (variant, per-rank microbatch size, split backward) measurements ``candidates``
    need, largest first (what a variant's biggest microbatch costs is learnt first)."""
    needs = set()
    for c in candidates:
        needs.add((c.variant, c.local_batch(batch), c.schedule in SPLIT_BACKWARD))
    if needs:  # the executor's own costs come from the unsplit run with the most instructions
        needs.add(("none", min(local for _, local, _ in needs), False))
    return sorted(needs, key=lambda n: (n[0] != "none", n[0], -n[1], n[2]))


def built_regions(stages: int | None, devices: int) -> int:
    """The regions a built-in model is built with for a search over ``devices``: ``stages``,
    else two per device."""
    return stages or 2 * devices


def tune(
    model: str | ModelSpec,
    devices: int,
    *,
    stages: int | None = None,
    memory_budget_bytes: int | None = None,
    microbatches: Sequence[int] = (1, 2, 4, 8, 16),
    schedules: Sequence[str] = tuple(SCHEDULES),
    zeros: Sequence[int] = (0, 1, 2, 3),
    kinds: Sequence[str] = ("tp", "ep"),
    pps: Sequence[int] | None = None,
    recompute: Sequence[bool] = (False,),
    sp: Sequence[bool] = (False,),
    cps: Sequence[int] = (1,),
    optimizer: OptimizerSpec | None = None,
    backend: str | None = "cpu",
    address: str | None = None,
    cache_dir: Path | None = DEFAULT_CACHE,
    comm: tuple[float, float] | None = None,
    profile_steps: int = 3,
    keep: int | None = None,
    seed: int = 0,
    progress: Callable[[int], Callable[[Evaluation], None]] | None = None,
    log: Log | None = None,
) -> TuneReport:
    """Search the strategies of ``model`` on ``devices`` devices (module doc).

    ``model``: a built-in name (``transformer``, ``moe``, ...; built with ``stages`` regions,
    default ``2 * devices``), ``path/to/file.py:factory``, or a ``ModelSpec``.
    ``memory_budget_bytes`` is per rank; a budget no candidate fits raises ``MemoryPlanError``
    naming the smallest estimated requirement. ``pps`` limits the pipeline degrees, ``kinds``
    the shard kinds (``"tp"``, ``"ep"``), ``recompute`` the recomputation choices
    (``(False, True)``: each candidate without tp/ep/cp also with every region recomputed),
    ``sp`` the sequence-parallel choices of each tp > 1 candidate (``(False, True)``: both),
    ``cps`` the context-parallel degrees (``(1, 2)``: pp x dp x (tp or ep) and pp x dp x 2).
    ``comm`` = (latency s, bandwidth bytes/s) replaces the measured link. ``keep=K`` ranks only the best K exactly (``search``: the
    rest are compiled only while they could still enter the top K); ``None`` ranks every
    candidate. ``progress(total)`` returns what hears each evaluation.
    """
    say = log or (lambda _: None)
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    check_devices(devices, address)
    name = model if isinstance(model, str) else model.name
    regions = built_regions(stages, devices)
    spec = load_workload(model, stages=regions, seed=seed) if isinstance(model, str) else model
    captured = capture(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, regions=spec.regions,
                       method=spec.capture)
    regions = len(captured.graph.stage_segments())
    if "ep" in kinds and not any(getattr(m, "piper_experts", False) for m in spec.model.modules()):
        kinds = [k for k in kinds if k != "ep"]  # every ep candidate would be refused, one by one
        say("no expert module (piper_experts = True) in the model: expert parallelism left out of the search")
    started = time.perf_counter()
    profiler = Profiler(name, spec, captured, backend=backend or "cpu", address=address, optimizer=optimizer,
                        cache_dir=cache_dir, comm=comm, steps=profile_steps, log=say)
    weights = profiler.profile.region_weights() if profiler.profile.compute.get("none") else None
    if weights is None:  # one run of the whole model first: what balancing the stages weighs
        profiler.need("none", captured.batch_size, False)
        weights = profiler.profile.region_weights()
    candidates = enumerate_space(devices, regions, microbatches=microbatches, schedules=schedules, zeros=zeros,
                                 kinds=kinds, weights=weights, pps=pps, recompute=recompute, sp=sp, cps=cps)
    shard = _Sharder(captured)
    buildable = _buildable(candidates, captured, regions, shard)
    for variant in sorted({c.variant for c in buildable} - {"none"}):
        if not variant.startswith("ep"):  # an expert group's ranks keep what one device keeps of their tokens
            profiler.need_activations(variant)
    for variant, local, split in _needs(buildable, captured.batch_size):
        try:
            profiler.need(variant, local, split)
        except PiperError as err:  # e.g. tensor parallelism on a model without Linear pairs
            say(f"profile: {variant} cannot run on this model: {str(err).splitlines()[0]}")
    profile_seconds = time.perf_counter() - started
    say(f"profile: {profiler.measured} runs in {profile_seconds:.1f} s")
    hear = progress(len(candidates)) if progress is not None else None
    result = search(captured.graph, profiler.profile, candidates, budget_bytes=memory_budget_bytes,
                    optimizer=(optimizer or OptimizerSpec()).name, shard=shard, keep=keep, progress=hear)
    report = TuneReport(name, devices, regions, result, profiler.profile, len(candidates), profile_seconds,
                        memory_budget_bytes, profiler.measured)
    if result.best is None and memory_budget_bytes is not None:
        smallest = result.smallest_requirement
        if smallest is not None:
            raise MemoryPlanError(
                f"no strategy fits the per-rank budget of {memory_budget_bytes / 2**20:.2f} MiB: the smallest "
                f"estimated requirement is {smallest.peak_bytes / 2**20:.2f} MiB ({smallest.candidate.label}; "
                f"{smallest.reason})"
            )
    if result.best is None:
        reasons = sorted({e.reason for e in result.evaluations})[:3]
        raise ValueError(f"no strategy in the space can run this model on {devices} devices: {'; '.join(reasons)}")
    return report


def _buildable(candidates: Iterable[Candidate], captured: CapturedModel, regions: int,
               shard: Callable[[Graph], Graph]) -> list[Candidate]:
    """The candidates whose program can be built at all (checked without compiling; a
    tensor- or expert-parallel variant once, on one stage), so the profiler measures nothing
    only invalid ones would use."""
    out = []
    batch = captured.batch_size
    variants: dict[str, bool] = {}
    for c in candidates:
        if batch % (c.microbatches * c.shards):
            continue
        try:
            c.strategy(regions)
        except PiperError:
            continue
        if c.variant not in variants:
            one = Candidate("1f1b", 1, batch // c.ep if c.ep > 1 else 1, tp=c.tp, ep=c.ep, sp=c.sp, cp=c.cp)
            try:
                shard(one.strategy(regions).apply(captured.graph))
                variants[c.variant] = True
            except PiperError:
                variants[c.variant] = False
        if variants[c.variant]:
            out.append(c)
    return out


class _Sharder:
    """``Trainer``'s tensor/expert-parallel graph rewrite (``shard_modules``: which
    parameters each group cuts, the buckets rebuilt on the shards), remembered per
    (segment, kind, degree, sequence-parallel): the rewrite runs the segments' code, far longer than compiling,
    and what it decides does not depend on the placement. A graph whose shardings are all
    known is rewritten from memory with the same bucket builders; a combination that failed
    fails again with the same error. A context-parallel graph goes through
    ``context_modules``, whose result (each rank's value shapes, each segment's gather count)
    depends on the values' shapes and the degree only, and is remembered per those."""

    def __init__(self, captured: CapturedModel) -> None:
        self.modules = captured.modules
        self.known: dict[tuple, tuple] = {}
        self.failed: dict[frozenset, PiperError] = {}
        self.context: dict[tuple, tuple] = {}  # (degree, values) -> (values, segment -> gathers)

    def __call__(self, graph: Graph) -> Graph:
        if not graph.sharding:
            return graph
        kinds = frozenset((sh.kind, sh.degree, sh.sequence_parallel, sh.expert_degree) for sh in graph.sharding)
        if kinds in self.failed:
            raise self.failed[kinds]
        if any(sh.kind is ShardKind.CP for sh in graph.sharding):
            return self._context(graph, kinds)
        if all((sh.segment, sh.kind, sh.degree, sh.sequence_parallel) in self.known for sh in graph.sharding):
            return self._replay(graph)
        try:
            out = shard_modules(graph, self.modules)[0]
        except PiperError as err:
            self.failed[kinds] = err
            raise
        for sh in out.sharding:
            self.known[(sh.segment, sh.kind, sh.degree, sh.sequence_parallel, sh.expert_degree)] = (sh.params, sh.collectives)
        return out

    def _context(self, graph: Graph, kinds: frozenset) -> Graph:
        key = (tuple(sorted(sh.degree for sh in graph.sharding)), graph.values)
        if key not in self.context:
            try:
                out = context_modules(graph, self.modules)[0]
            except PiperError as err:
                self.failed[kinds] = err
                raise
            self.context[key] = (out.values, {sh.segment: sh.collectives for sh in out.sharding})
        values, counts = self.context[key]
        sharding = tuple(attrs.evolve(sh, collectives=counts.get(sh.segment, sh.collectives)) for sh in graph.sharding)
        return attrs.evolve(graph, values=values, sharding=sharding)

    def _replay(self, graph: Graph) -> Graph:
        records = []
        for sh in graph.sharding:
            params, collectives = self.known[(sh.segment, sh.kind, sh.degree, sh.sequence_parallel, sh.expert_degree)]
            records.append(attrs.evolve(sh, params=params, collectives=collectives))
        graph = attrs.evolve(graph, sharding=tuple(records))
        return attrs.evolve(graph, buckets=sharded_buckets(graph))


@attrs.frozen
class Measured:
    """A candidate run on the runtime: the driver's median step time and each rank's peak
    memory (``RankMemory.total``) over the timed steps."""

    evaluation: Evaluation
    seconds: float | None
    peak_bytes: tuple[int, ...] = ()
    error: str = ""


def measure_step(
    spec: ModelSpec,
    candidate: Candidate,
    regions: int,
    *,
    steps: int = 5,
    warmup: int = 2,
    optimizer: OptimizerSpec | None = None,
    backend: str | None = "cpu",
    address: str | None = None,
    memory_budget_bytes: int | None = None,
) -> tuple[float, tuple[int, ...]]:
    """Train ``candidate`` for ``warmup + steps`` steps on ``spec``'s batches; the median
    driver-measured step time of the timed steps and each rank's peak memory."""
    times = []
    with Trainer(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, candidate.strategy(regions),
                 regions=spec.regions, capture_method=spec.capture,
                 optimizer=optimizer or OptimizerSpec(), backend=backend, address=address, reuse_workers=True,
                 memory_budget_bytes=memory_budget_bytes) as trainer:
        for step in range(warmup + steps):
            inputs, targets = spec.batches(step)
            started = time.perf_counter()
            trainer.step(inputs, targets)
            if step >= warmup:
                times.append(time.perf_counter() - started)
        # Memory accounting slows a step down: one more, accounted and not timed, for the peaks.
        accounted = trainer.step(*spec.batches(warmup + steps), memory=True)
    return statistics.median(times), tuple(m.total for m in accounted.memory)


def validate(
    report: TuneReport,
    model: str | ModelSpec,
    top: int,
    *,
    steps: int = 5,
    warmup: int = 2,
    optimizer: OptimizerSpec | None = None,
    backend: str | None = "cpu",
    address: str | None = None,
    seed: int = 0,
    log: Log | None = None,
) -> list[Measured]:
    """Run the ``top`` best candidates of ``report`` on the runtime: predicted vs measured."""
    say = log or (lambda _: None)
    spec = load_workload(model, stages=report.regions, seed=seed) if isinstance(model, str) else model
    out = []
    for e in report.result.fitting[:top]:
        try:
            seconds, peaks = measure_step(spec, e.candidate, report.regions, steps=steps, warmup=warmup,
                                          optimizer=optimizer, backend=backend, address=address,
                                          memory_budget_bytes=report.budget_bytes)
            out.append(Measured(e, seconds, peaks))
            say(f"validate: {e.candidate.label}: predicted {e.predicted * 1e3:.1f} ms, measured {seconds * 1e3:.1f} ms")
        except PiperError as err:
            out.append(Measured(e, None, (), str(err).splitlines()[0]))
            say(f"validate: {e.candidate.label}: failed: {str(err).splitlines()[0]}")
    return out
