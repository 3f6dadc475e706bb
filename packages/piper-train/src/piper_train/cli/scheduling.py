"""``piper simulate``, ``piper plan`` and ``piper show``: scheduling without processes.

None of them imports torch or ray, except ``piper plan --model``, which captures a model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from piper_directives import Strategy, strategy_to_torch_csv, synthetic_graph
from piper_ir import (
    Graph,
    PiperError,
    Program,
    SerializationError,
    from_json,
    graph_summary,
    program_text,
    to_json,
)
from piper_memory import plan_memory
from piper_scheduler import CostModel, compile_program, plot_gantt, simulate, to_chrome_trace, verify
from piper_train.cli.document import emit
from piper_train.cli.options import say
from piper_train.cli.outputs import writing
from piper_train.cli.request import StrategyRequest, model_regions, placed_regions, split_microbatches
from piper_train.metrics import SCHEMA

# The largest synthetic pipeline simulate and plan build: regions x microbatches x segments
# per region. Work and memory grow with it (64 x 256 x 2 compiles in ~6 s, 128 x 512 x 1 in
# ~17 s, docs/compile-scaling.md); beyond it, refusing at once beats minutes of swapping.
MAX_CELLS = 100_000
# A step of building a plan that takes this long is said as it ends (on stderr).
SAY_AFTER_S = 1.0
T = TypeVar("T")
R = TypeVar("R")


def costs(text: str) -> CostModel:
    """``--cost`` as a ``CostModel`` (``CostModel.parse``: ``F=1,B=3,W=1`` derives ``BI=2``)."""
    return CostModel.parse(text, source="--cost")


def check_size(args: argparse.Namespace, regions: int | None = None, microbatches: int | None = None) -> None:
    """Refuse a synthetic pipeline larger than ``MAX_CELLS`` before building it, naming the
    options. Without ``regions``/``microbatches`` (before the strategy is built) it bounds
    what the options alone say: --stages (or --pp) x --microbatches x --segments-per-stage."""
    stages = regions or args.stages or args.pp
    mbs = microbatches or args.microbatches
    segments = getattr(args, "segments_per_stage", 1)
    cells = stages * mbs * segments
    if cells > MAX_CELLS:
        raise ValueError(
            f"the pipeline is too large to {args.command}: {stages} stages (--stages/--pp) x {mbs} microbatches "
            f"(--microbatches) x {segments} segments per stage (--segments-per-stage) = {cells:,} compute cells; "
            f"the limit is {MAX_CELLS:,} (docs/reliability.md)"
        )


def _synthetic(args: argparse.Namespace, regions: int, microbatches: int, segments_per_region: int = 1) -> Graph:
    return synthetic_graph(regions, microbatches or args.microbatches, segments_per_region, hidden=16, batch=1)


def _report(args: argparse.Namespace, program: Program, what: str) -> int:
    timeline = simulate(program, costs(args.cost))
    summary = {
        "schema": SCHEMA,
        "command": args.command,
        "description": what,
        "ranks": program.world_size,
        "microbatches": program.microbatches,
        "makespan": timeline.makespan,
        "busy": list(timeline.busy),
        "idle": list(timeline.idle),
        "bubble_fraction": [i / timeline.makespan if timeline.makespan else 0.0 for i in timeline.idle],
        "peak_activations": list(timeline.peak_memory),
    }
    if args.trace is not None:
        with writing(args.trace, "--trace"):
            args.trace.write_text(json.dumps(to_chrome_trace(timeline)))
        say(args, f"wrote {args.trace}")
    if args.png is not None:
        with writing(args.png, "--png"):
            plot_gantt(timeline, args.png, title=f"{what}: makespan {timeline.makespan:g}")
        say(args, f"wrote {args.png}")
    if args.json:
        emit(args, summary)
        return 0
    say(args, f"{what}: makespan {timeline.makespan:g} (costs {args.cost})")
    say(args, "rank      busy      idle  bubble  peak activations")
    for r in range(program.world_size):
        say(args, f"{r:>4} {timeline.busy[r]:>9g} {timeline.idle[r]:>9g} {summary['bubble_fraction'][r]:>6.1%}"
                  f"  {timeline.peak_memory[r]:>5}")
    return 0


class _Steps:
    """Says on stderr each step of building a plan that took ``SAY_AFTER_S`` or more, as it
    ends: a large pipeline takes seconds per step (16,384 devices: 20-25 s in all), which
    should not pass in silence. Small plans print nothing extra."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __call__(self, name: str, seconds: float) -> None:
        if seconds >= SAY_AFTER_S:
            print(f"{self.command}: {name} took {seconds:.1f} s", file=sys.stderr, flush=True)

    def timed(self, name: str, fn: Callable[[T], R], arg: T) -> R:
        started = time.perf_counter()
        out = fn(arg)
        self(name, time.perf_counter() - started)
        return out


def _compiled(strategy: Strategy, graph: Graph, steps: _Steps, *, memory: bool) -> tuple[Graph, Program]:
    """``graph`` placed by ``strategy``, and its program (after ``plan_memory`` when
    ``memory``: ZeRO's collectives and a tied parameter's sums are part of the plan)."""
    placed = strategy.apply(graph, progress=lambda name, seconds: steps(f"strategy phase {name!r}", seconds))
    planned = steps.timed("memory plan", plan_memory, placed) if memory else placed
    return placed, steps.timed("compile (with verify)", compile_program, planned)


def simulate_command(args: argparse.Namespace) -> int:
    if args.hardware is not None:  # a model's strategy priced on hardware (imports torch: only here)
        from piper_train.cli.planning import simulate_plan

        return simulate_plan(args)
    given = [flag for flag, value in (("--devices", args.devices), ("--model", args.model),
                                      ("--batch-size", args.batch_size), ("--seq-len", args.seq_len))
             if value is not None]
    given += [flag for flag, on in (("--tp", args.tp != 1), ("--zero", args.plan_zero != 0),
                                    ("--recompute", args.plan_recompute != "none"), ("--sp", args.plan_sp),
                                    ("--cp", args.plan_cp != 1)) if on]
    if given:
        raise ValueError(f"{', '.join(given)} price a model's strategy on hardware: give --hardware too")
    check_size(args)
    request = StrategyRequest.from_args(args)
    strategy = request.resolve(args.stages)
    regions = placed_regions(strategy)
    microbatches = split_microbatches(strategy, args.microbatches)
    check_size(args, regions, microbatches)  # a --strategy file sets its own
    graph = _synthetic(args, regions, microbatches, args.segments_per_stage)
    _, program = _compiled(strategy, graph, _Steps("simulate"), memory=False)
    return _report(args, program, f"{request.name} pp={program.world_size} stages={regions} microbatches={microbatches}")


def plan_command(args: argparse.Namespace) -> int:
    check_size(args)
    request = StrategyRequest.from_args(args)
    if args.model is not None:
        graph = _capture(args, model_regions(args))
        regions = len({s.tags.get("PP") for s in graph.stage_segments()} - {None})
        strategy = request.resolve(regions if request.needs_regions else None)
        request.check_regions(regions)
    else:
        strategy = request.resolve(args.stages)
        check_size(args, placed_regions(strategy), split_microbatches(strategy, args.microbatches))
        graph = _synthetic(args, placed_regions(strategy), split_microbatches(strategy, args.microbatches))
    started = time.perf_counter()
    steps = _Steps("plan")
    placed, program = _compiled(strategy, graph, steps, memory=True)
    seconds = time.perf_counter() - started
    text = steps.timed("JSON of the program", to_json, program)
    with writing(args.out, "--out"):
        steps.timed(f"writing {args.out}", args.out.write_text, text)
    if args.torch_csv is not None:
        with writing(args.torch_csv, "--torch-csv"):
            args.torch_csv.write_text(strategy_to_torch_csv(strategy))
        print(f"wrote {args.torch_csv} (torch pipelining schedule, compute actions)")
    print(graph_summary(placed).splitlines()[0])
    print(f"compiled {program.world_size} rank plans, {sum(len(p.instructions) for p in program.ranks)} "
          f"instructions in {seconds:.2f} s; wrote {args.out}")
    print(f"communicators: {_communicators(program)}; verified")
    for tie in program.ties:
        sums = sorted({c.id for c in program.communicators if c.traffic == "tie"})
        print(f"tied: {tie.name} held by {', '.join(f'{s}:{q}' for s, q in tie.holders)}"
              + (f"; gradients summed on {', '.join(sums)}" if sums else "; one tensor per rank, no sum needed"))
    return 0


def _communicators(program: Program) -> str:
    return ", ".join(f"{c.id} ({c.traffic})" for c in program.communicators) or "none"


def _capture(args: argparse.Namespace, regions: int) -> Graph:
    # Imported here, not at the top: capturing a model needs torch, and importing it only
    # for `plan --model` keeps simulate, show and a synthetic plan free of torch.
    from piper_directives import capture
    from piper_train.workload import load_workload

    workload = load_workload(args.model, stages=regions, seed=args.seed, regions=args.regions, capture=args.capture)
    return capture(
        workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn, precision=args.precision,
        regions=workload.regions, method=workload.capture,
    ).graph


def _saved_program(path: Path, steps: _Steps) -> Program:
    """The verified program saved in ``path``. Anything else is an error naming the file (exit
    2): unreadable, not UTF-8 or not JSON (``from_json`` reads bytes), nested too deeply,
    another IR value, fields of the wrong names or types, or a plan ``verify`` refuses."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    try:
        program = steps.timed(f"reading {path}", from_json, data)
    except SerializationError as err:
        raise SerializationError(f"{path}: {err.message}") from None
    if not isinstance(program, Program):
        raise ValueError(f"{path} holds a {type(program).__name__}, not a Program")
    try:
        steps.timed("verify", verify, program)
    except PiperError as err:
        raise type(err)(f"{path} does not verify: {err.message}", directive=err.directive, nodes=err.nodes,
                        ranks=err.ranks, step=err.step) from None
    return program


def show_command(args: argparse.Namespace) -> int:
    steps = _Steps("show")
    program = _saved_program(args.program, steps)
    counts: dict[str, int] = {}
    for plan in program.ranks:
        for ins in plan.instructions:
            counts[ins.kind.value] = counts.get(ins.kind.value, 0) + 1
    say(args, program_text(program))
    say(args, f"\n{program.world_size} ranks, {program.microbatches} microbatches, "
              f"{sum(counts.values())} instructions ({', '.join(f'{k}={v}' for k, v in sorted(counts.items()))}); "
              f"communicators: {_communicators(program)}; verified")
    return _report(args, program, str(args.program))
