"""The strategy the user asked for on the command line.

A pipeline program comes from a library schedule (``--schedule/--pp/--microbatches``) or a
file (``--strategy``: a JSON directive program, or a torch.distributed.pipelining CSV); the
parallelisms (``--dp/--zero/--tp/--ep``) go on top of it with ``parallelize``, the same
composition ``build_schedule`` and ``Trainer.with_schedule`` use, and ``--recompute`` adds a
``Recompute`` of every region (``all``) or of every N-th one.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import attrs

from piper_directives import (
    Place,
    Recompute,
    SizedStrategy,
    Split,
    Strategy,
    build_schedule,
    context_parallel,
    device_count,
    parallelize,
    strategy_from_torch_csv,
    written_at,
)
from piper_ir import DirectiveError, PiperError


@attrs.frozen
class StrategyRequest:
    """What ``--schedule``/``--strategy`` and ``--dp/--zero/--tp/--ep`` ask for.
    ``resolve(regions)`` is the ``Strategy`` for a model with that many annotated regions."""

    schedule: str = "1f1b"
    pp: int = 2
    microbatches: int = 4
    file: Path | None = None
    program: Strategy | None = None  # a JSON directive program read from ``file``
    torch_csv: str | None = None  # a torch pipelining schedule read from ``file``
    dp: int = 1
    zero: int = 0
    tp: int = 1
    ep: int = 1
    stages: int | None = None  # --stages: the model's annotated regions, when the user says
    recompute: int = 0  # --recompute: 0 none, 1 every region, N every N-th region (0, N, 2N, ...)
    tp_plan: tuple[tuple[str, str], ...] = ()  # --tp-plan: the Shards' plan by module path (empty: found)
    sp: bool = False  # --sp: sequence parallelism between the tensor-parallel regions
    cp: int = 1  # --cp: every device widened to a context-parallel group of this many

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StrategyRequest:
        """The request of parsed arguments. ``--strategy`` is read (and a JSON program parsed)
        now, so a file that cannot be is reported before anything runs. Commands without
        the parallelism options get none."""
        program = torch_csv = None
        if args.strategy is not None:
            try:
                text = args.strategy.read_text(encoding="utf-8")
            except OSError as err:
                raise ValueError(f"cannot read --strategy {args.strategy}: {err}") from None
            except UnicodeDecodeError as err:
                raise ValueError(f"--strategy {args.strategy} is not UTF-8 text (byte {err.start}: "
                                 f"{err.reason}); a strategy is a .json directive program or a .csv schedule") from None
            if args.strategy.suffix.lower() == ".csv":
                torch_csv = text
            else:
                program = Strategy.from_json(text, source=str(args.strategy))
        return cls(
            args.schedule, args.pp, args.microbatches, args.strategy, program, torch_csv,
            getattr(args, "dp", 1), getattr(args, "zero", 0), getattr(args, "tp", 1), getattr(args, "ep", 1),
            getattr(args, "stages", None), getattr(args, "recompute", 0), getattr(args, "tp_plan", None) or (),
            bool(getattr(args, "sp", False)), getattr(args, "cp", 1),
        )

    @property
    def name(self) -> str:
        """How messages name the pipeline: the file, else the schedule."""
        return str(self.file) if self.file is not None else self.schedule

    @property
    def needs_regions(self) -> bool:
        """Whether the pipeline depends on the model's region count (a JSON program does not)."""
        return self.program is None

    def pipeline(self, regions: int | None) -> Strategy:
        """The pipeline program, before ``--dp/--zero/--tp/--ep``. ``regions=None``: the
        schedule's own default (or, for a torch CSV, the file's stage count)."""
        if self.program is not None:
            return self.program
        if self.torch_csv is not None:
            # ranks and microbatches come from the file; regions default to its stage count
            with written_at(f"--strategy {self.file}"):
                return strategy_from_torch_csv(self.torch_csv, None, None, stages=regions)
        with written_at(f"the command line (--schedule {self.schedule} --pp {self.pp} "
                        f"--microbatches {self.microbatches})"):
            return build_schedule(self.schedule, self.pp, self.microbatches, stages=regions)

    def resolve(self, regions: int | None) -> Strategy:
        """The strategy for a model of ``regions`` regions: the pipeline, then ``--dp/--zero/
        --tp/--ep/--sp``, ``--recompute`` and ``--cp``, each directive naming its flags."""
        strategy = self._parallel(regions)
        if self.cp == 1:
            return strategy
        with written_at(f"the command line (--cp {self.cp})"):
            return context_parallel(strategy, self.cp)

    def _parallel(self, regions: int | None) -> Strategy:
        self.check_regions(regions)
        pipeline = self.pipeline(regions)
        flags = " ".join(f"--{k} {v}" for k, v in (("dp", self.dp), ("zero", self.zero), ("tp", self.tp), ("ep", self.ep)))
        if self.tp_plan:
            flags += " --tp-plan " + ",".join(f"{k}={v}" for k, v in self.tp_plan)
        if self.sp:
            flags += " --sp"
        with written_at(f"the command line ({flags})"):
            strategy = parallelize(pipeline, dp=self.dp, zero=self.zero, tp=self.tp, ep=self.ep,
                                   tp_plan=dict(self.tp_plan) or None, sp=self.sp)
        if not self.recompute:
            return strategy
        with written_at(f"the command line (--recompute {self.recompute_name})"):
            if self.recompute == 1:
                return Strategy([*strategy.directives, Recompute({})])  # an empty filter: every region
            count = regions if regions is not None else placed_regions(strategy)
            picked = [Recompute({"PP": k}) for k in range(0, count, self.recompute)]
            return Strategy([*strategy.directives, *picked])

    @property
    def recompute_name(self) -> str:
        """How ``--recompute`` was given: ``all``, or the interval N."""
        return "all" if self.recompute == 1 else str(self.recompute)

    def check_regions(self, regions: int | None) -> None:
        """``--stages`` is honoured, never ignored: a model whose region count differs from it
        is refused (a built-in model is built with that many; a model file has the regions
        its ``forward`` annotates)."""
        if self.stages is not None and regions is not None and regions != self.stages:
            raise DirectiveError(
                f"--stages {self.stages}: the model has {regions} annotated regions. --stages chooses the "
                "regions of a built-in model; a model from a file has the regions its forward annotates "
                f"(drop --stages, or pass --stages {regions})"
            )

    def for_trainer(self) -> Strategy | Callable[[int], Strategy]:
        """What ``Trainer`` and ``run_check`` take: ``resolve`` itself, called with the
        captured model's region count, or, when the pipeline does not depend on it, the
        strategy (composed now, so its errors come before the model is captured), checked
        against ``--stages`` once the model is captured."""
        if self.needs_regions:
            # Its device count is known now: the runtime starts while the model is captured.
            ranks, _ = self.shape()
            return SizedStrategy(self.resolve, devices=ranks * self.dp * self.tp * self.ep * self.cp)
        strategy = self.resolve(None)
        if self.stages is None:
            return strategy

        def checked(regions: int) -> Strategy:
            self.check_regions(regions)
            return strategy

        return SizedStrategy(checked, devices=device_count(strategy) or 1)

    def shape(self) -> tuple[int, int]:
        """``(pipeline ranks, microbatches)`` of the pipeline program: what ``--pp`` and
        ``--microbatches`` say, or what a ``--strategy`` file itself says."""
        if self.file is None:
            return self.pp, self.microbatches
        pipeline = self.pipeline(None)
        ranks = {d for place in pipeline.of(Place) for d in place.devices}
        return len(ranks), split_microbatches(pipeline, self.microbatches)


def placed_regions(strategy: Strategy) -> int:
    """How many ``PP`` regions ``strategy`` places (the schedule's default when --stages is absent)."""
    return len({d.filter.as_dict().get("PP") for d in strategy.of(Place)} - {None})


def split_microbatches(strategy: Strategy, default: int) -> int:
    """The strategy's ``Split`` count (a loaded strategy fixes its own), else ``default``;
    a count that is not a positive int is the Split's error (before a graph is built for it)."""
    split = next(iter(strategy.of(Split)), None)
    if split is None:
        return default
    m = split.microbatches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise DirectiveError(f"microbatches must be a positive int, got {m!r}", directive=str(split))
    return m


def model_regions(args: argparse.Namespace) -> int:
    """Regions a built-in model gets: ``--stages``, else the regions a JSON ``--strategy``
    places, else what the schedule places on ``--pp`` ranks (``2 * pp`` for interleaved_1f1b
    and dualpipev), else ``--pp``."""
    if args.stages:
        return args.stages
    if args.strategy is not None and args.strategy.suffix.lower() != ".csv":
        # A JSON program places its regions itself (``piper tune --out`` writes one per region).
        try:
            return placed_regions(Strategy.from_json(args.strategy.read_text(encoding="utf-8"))) or args.pp
        except (OSError, ValueError, PiperError):  # ValueError: not UTF-8
            pass  # StrategyRequest.from_args reads it again and reports what is wrong
    if args.strategy is None:
        try:
            return placed_regions(build_schedule(args.schedule, args.pp, args.microbatches)) or args.pp
        except PiperError:
            pass  # the same call fails again later with the message the user needs
    return args.pp
