"""The ``piper`` command: ``piper train``, ``piper check``, ``piper simulate``, ``piper plan``
and ``piper show``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from piper_directives import SCHEDULES, Strategy, build_schedule
from piper_ir import PiperError
from piper_runtime import OptimizerSpec


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="lm", help="mlp, transformer, lm, moe, or path/to/file.py:factory (default: lm)")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="pipeline schedule (default: 1f1b)")
    p.add_argument("--strategy", type=Path, help=_STRATEGY_HELP)
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (default: 2)")
    p.add_argument("--stages", type=int,
                   help="annotated regions of a built-in model (default: what the schedule places on --pp ranks)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default: 4)")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas of the pipeline; devices = pp x dp x tp x ep (default: 1)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="ZeRO level with --dp > 1 or --ep > 1 (for --ep: on the non-expert weights, and on "
                        "the experts across --dp) (default: 0)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per pipeline stage and replica (Megatron-style Shard; adjacent "
                        "devices) (default: 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks per pipeline stage and replica (Shard kind='ep': data-parallel for "
                        "non-expert weights, experts split across the group, each expert's gradient reduced "
                        "over the --dp ranks holding it; adjacent devices) (default: 1)")
    p.add_argument("--memory-budget-mb", type=float, default=None,
                   help="fail at compile time if a rank's estimated memory exceeds this many MiB")
    p.add_argument("--optimizer", default="adamw", choices=["sgd", "adam", "adamw"], help="(default: adamw)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 3e-3 for adam/adamw, 0.05 for sgd)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", help="Ray cluster address; default: start an embedded local cluster")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")


_STRATEGY_HELP = ("a directive program (.json) or a torch.distributed.pipelining schedule (.csv, one row of "
                  "actions per rank); replaces --schedule/--pp/--microbatches")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="piper", description="Programmable distributed training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model with a strategy on Ray")
    _add_common(train)
    train.add_argument("--steps", type=int, default=20)
    check = sub.add_parser("check", help="compare a strategy with single-device training")
    _add_common(check)
    check.add_argument("--steps", type=int, default=3)
    check.add_argument("--rtol", type=float, default=1e-5)
    check.add_argument("--atol", type=float, default=1e-6)
    _add_scheduler_commands(sub)
    return parser


def _strategy(args: argparse.Namespace):
    """A ``Strategy``, or a function of the number of annotated regions that builds one."""
    if args.strategy is not None:
        try:
            text = args.strategy.read_text()
        except OSError as err:
            raise ValueError(f"cannot read --strategy {args.strategy}: {err}") from None
        if args.strategy.suffix.lower() == ".csv":
            from piper_directives import strategy_from_torch_csv

            # ranks and microbatches come from the file; regions default to its stage count
            return lambda stages: strategy_from_torch_csv(text, None, None, stages=stages)
        return Strategy.from_json(text, source=str(args.strategy))

    def build(stages: int) -> Strategy:
        return build_schedule(args.schedule, args.pp, args.microbatches, stages=stages)

    return build


def _replicated(args: argparse.Namespace, strategy):
    """``_strategy``'s result with ``--dp``/``--zero`` (``data_parallel``) applied, then
    ``--tp`` (``tensor_parallel``) or ``--ep`` (``expert_parallel``) on top: a library
    schedule or the user's own pipeline-only strategy file alike. Devices are laid out
    replica-major with the tensor- or expert-parallel ranks adjacent: stage ``r`` of replica
    ``j`` runs on ``(r + j * pp) * k + t`` for ``t < k`` (``k`` = tp or ep)."""
    dp, zero, tp, ep = args.dp, args.zero, getattr(args, "tp", 1), getattr(args, "ep", 1)
    if dp == 1 and zero == 0 and tp == 1 and ep == 1:
        return strategy

    def compose(s: Strategy) -> Strategy:
        from piper_directives import data_parallel, expert_parallel, tensor_parallel

        if dp > 1:
            s = data_parallel(s, dp, zero)
        if ep > 1:
            # An expert-parallel group is data-parallel for the non-expert weights by itself,
            # so --zero applies even without --dp.
            return expert_parallel(s, ep, zero=zero if dp == 1 and zero else None)
        if tp > 1:
            return tensor_parallel(s, tp)
        return s if dp > 1 else data_parallel(s, dp, zero)

    if isinstance(strategy, Strategy):
        return compose(strategy)
    return lambda stages: compose(strategy(stages))


def _budget(args: argparse.Namespace) -> int | None:
    return None if args.memory_budget_mb is None else int(args.memory_budget_mb * 2**20)


def _optimizer(args: argparse.Namespace) -> OptimizerSpec:
    lr = args.lr if args.lr is not None else (0.05 if args.optimizer == "sgd" else 3e-3)
    return OptimizerSpec(args.optimizer, lr)


def _say(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def _train(args: argparse.Namespace) -> int:
    from piper_train.trainer import Trainer
    from piper_train.workload import load_workload

    workload = load_workload(args.model, stages=_model_stages(args), seed=args.seed)
    _say(args, f"piper train: model {args.model}, {args.strategy or args.schedule}, pp={args.pp}, dp={args.dp}, "
               f"tp={args.tp}, ep={args.ep}, zero={args.zero}, microbatches={args.microbatches}, {args.steps} steps")
    started = time.perf_counter()
    with Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
                 _replicated(args, _strategy(args)), optimizer=_optimizer(args), address=args.address,
                 memory_budget_bytes=_budget(args), log=lambda text: _say(args, text)) as trainer:
        _say(args, f"workers up after {time.perf_counter() - started:.1f} s")
        losses, times = [], []
        for step in range(args.steps):
            inputs, targets = workload.batches(step)
            t0 = time.perf_counter()
            result = trainer.step(inputs, targets)
            times.append(time.perf_counter() - t0)
            losses.append(result.loss)
            _say(args, f"step {step + 1:>4}/{args.steps}  loss {result.loss:8.4f}  {times[-1] * 1000:7.1f} ms/step")
    steady = times[1:] or times
    summary = {
        "command": "train", "model": args.model, "schedule": None if args.strategy else args.schedule,
        "strategy": str(args.strategy) if args.strategy else None, "pp": len(trainer.program.ranks) // (trainer.program.replicas * args.tp),
        "dp": trainer.program.replicas // args.ep, "tp": args.tp, "ep": args.ep, "zero": args.zero,
        "microbatches": trainer.program.microbatches, "steps": args.steps, "losses": losses,
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "mean_step_seconds": sum(steady) / len(steady) if steady else None,
        "compile_seconds": trainer.compile_seconds,
    }
    if args.json:
        print(json.dumps(summary))
    elif losses:
        _say(args, f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {summary['mean_step_seconds'] * 1000:.1f} ms/step")
    return 0


def _check(args: argparse.Namespace) -> int:
    from piper_train.check import run_check
    from piper_train.workload import load_workload

    workload = load_workload(args.model, stages=_model_stages(args), seed=args.seed)
    _say(args, f"piper check: model {args.model}, {args.strategy or args.schedule}, pp={args.pp}, dp={args.dp}, "
               f"tp={args.tp}, ep={args.ep}, zero={args.zero}, microbatches={args.microbatches}, {args.steps} steps vs single-device training")
    report = run_check(workload, _replicated(args, _strategy(args)), steps=args.steps, optimizer=_optimizer(args),
                       rtol=args.rtol, atol=args.atol, address=args.address, log=lambda s: _say(args, s),
                       memory_budget_bytes=_budget(args))
    rows = {what: report.worst(what) for what in ("loss", "grad", "param")}
    for what, d in rows.items():
        _say(args, f"largest {what:<5} difference: abs {d.abs:.3e}  rel {d.rel:.3e}  ({d.where})")
    verdict = "PASS" if report.ok else "FAIL"
    _say(args, f"{verdict}: within rtol={args.rtol:g}, atol={args.atol:g}" if report.ok
         else f"{verdict}: differences exceed rtol={args.rtol:g}, atol={args.atol:g}")
    if args.json:
        print(json.dumps({"command": "check", "ok": report.ok, "steps": report.steps,
                          **{f"max_{w}_abs": d.abs for w, d in rows.items()},
                          **{f"max_{w}_rel": d.rel for w, d in rows.items()}}))
    return 0 if report.ok else 1


# --- simulate / plan / show: scheduling without processes ------------------------------------

_COST_KEYS = {"F": "F", "B": "B", "BI": "BI", "BW": "BW", "W": "BW", "OPT": "OPT", "FB": "FB"}


def _costs(text: str):
    """``F=1,B=2,W=1[,BI=..][,OPT=..][,FB=..][,loss=0]`` as a CostModel; the loss is free unless
    given. ``FB`` is an overlapped forward+backward pair (DualPipe's F&B)."""
    from piper_scheduler import CostModel

    fields: dict[str, float] = {}
    loss = 0.0
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, val = item.partition("=")
        try:
            number = float(val)
        except ValueError:
            number = -1.0
        if not sep or number < 0 or (key not in _COST_KEYS and key != "loss"):
            raise ValueError(f"--cost: expected KEY=NUMBER with KEY in F, B, BI, BW (or W), OPT, FB, loss; got {item!r}")
        if key == "loss":
            loss = number
        else:
            fields[_COST_KEYS[key]] = number
    return CostModel(**fields, overrides={"loss": {"F": loss, "B": loss, "BI": loss, "BW": loss}})


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="pipeline schedule (default: 1f1b)")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (default: 2)")
    p.add_argument("--stages", type=int, help="annotated regions (default: --pp)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default: 4)")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost", default="F=1,B=2,W=1", help="per-phase costs, e.g. F=1,B=2,W=1,FB=2.5,loss=0 (FB: an overlapped "
                   "F&B pair; default: F=1,B=2,W=1)")
    p.add_argument("--json", action="store_true", help="print makespan, per-rank busy and idle time as JSON")
    p.add_argument("--png", type=Path, help="write a Gantt chart of the simulated step (needs matplotlib)")
    p.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace of the simulated step")


def _add_scheduler_commands(sub) -> None:
    simulate = sub.add_parser("simulate", help="simulate a schedule on a synthetic model (no torch work)")
    _add_schedule_args(simulate)
    simulate.add_argument("--segments-per-stage", type=int, default=1, help="segments in each region (default: 1)")
    simulate.add_argument("--strategy", type=Path, help=_STRATEGY_HELP)
    _add_output_args(simulate)
    plan = sub.add_parser("plan", help="compile a strategy to a program and save it as JSON")
    _add_schedule_args(plan)
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--model", help="mlp, transformer, lm, or path/to/file.py:factory: capture this model")
    source.add_argument("--synthetic", action="store_true", help="a synthetic chain of regions (default)")
    plan.add_argument("--strategy", type=Path, help=_STRATEGY_HELP)
    plan.add_argument("--torch-csv", type=Path, help="also write the strategy's compute actions as a torch "
                      "pipelining schedule CSV (one row per rank)")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--out", type=Path, required=True, help="where to write the program (piper-ir JSON)")
    show = sub.add_parser("show", help="print a saved program as a rank x step grid, simulate it")
    show.add_argument("program", type=Path, help="a program written by 'piper plan'")
    _add_output_args(show)


def _schedule_graph(args: argparse.Namespace, stages: int, segments_per_stage: int = 1,
                    microbatches: int | None = None):
    from piper_directives.synthetic import synthetic_graph

    return synthetic_graph(stages, microbatches or args.microbatches, segments_per_stage, hidden=16, batch=1)


def _microbatches(strategy: Strategy, default: int) -> int:
    """The strategy's ``Split`` count (a loaded strategy fixes its own), else ``default``."""
    from piper_directives import Split

    return next((d.microbatches for d in strategy.directives if isinstance(d, Split)), default)


def _report(args: argparse.Namespace, program, what: str) -> int:
    from piper_scheduler import plot_gantt, simulate, to_chrome_trace

    timeline = simulate(program, _costs(args.cost))
    summary = {
        "what": what,
        "ranks": program.world_size,
        "microbatches": program.microbatches,
        "makespan": timeline.makespan,
        "busy": list(timeline.busy),
        "idle": list(timeline.idle),
        "bubble_fraction": [i / timeline.makespan if timeline.makespan else 0.0 for i in timeline.idle],
        "peak_activations": list(timeline.peak_memory),
    }
    if args.trace is not None:
        args.trace.write_text(json.dumps(to_chrome_trace(timeline)))
        _say(args, f"wrote {args.trace}")
    if args.png is not None:
        plot_gantt(timeline, args.png, title=f"{what}: makespan {timeline.makespan:g}")
        _say(args, f"wrote {args.png}")
    if args.json:
        print(json.dumps(summary))
        return 0
    _say(args, f"{what}: makespan {timeline.makespan:g} (costs {args.cost})")
    _say(args, "rank      busy      idle  bubble  peak activations")
    for r in range(program.world_size):
        _say(args, f"{r:>4} {timeline.busy[r]:>9g} {timeline.idle[r]:>9g} {summary['bubble_fraction'][r]:>6.1%}"
                   f"  {timeline.peak_memory[r]:>5}")
    return 0


def _model_stages(args: argparse.Namespace) -> int:
    """Regions a built-in model gets: ``--stages``, else what the schedule places on ``--pp``
    ranks (``2 * pp`` for interleaved_1f1b and dualpipev), else ``--pp``."""
    if args.stages:
        return args.stages
    if args.strategy is None:
        try:
            return _placed_stages(build_schedule(args.schedule, args.pp, args.microbatches)) or args.pp
        except PiperError:
            pass  # the same call fails again later with the message the user needs
    return args.pp


def _placed_stages(strategy: Strategy) -> int:
    """How many ``PP`` regions ``strategy`` places (the schedule's default when --stages is absent)."""
    from piper_directives.place import Place

    return len({d.filter.as_dict().get("PP") for d in strategy.directives if isinstance(d, Place)} - {None})


def _simulate(args: argparse.Namespace) -> int:
    from piper_directives.schedules import build_schedule as build
    from piper_scheduler import compile_program

    if args.strategy is not None:
        strategy = _strategy(args)
        strategy = strategy if isinstance(strategy, Strategy) else strategy(args.stages)
        name = str(args.strategy)
    else:
        strategy = build(args.schedule, args.pp, args.microbatches, stages=args.stages)
        name = args.schedule
    stages = _placed_stages(strategy)
    microbatches = _microbatches(strategy, args.microbatches)
    graph = _schedule_graph(args, stages, args.segments_per_stage, microbatches)
    program = compile_program(strategy.apply(graph))
    return _report(args, program, f"{name} pp={program.world_size} stages={stages} microbatches={microbatches}")


def _plan(args: argparse.Namespace) -> int:
    from piper_ir import graph_summary, to_json
    from piper_scheduler import compile_program

    stages = _model_stages(args)
    if args.model is not None:
        from piper_directives import capture
        from piper_train.workload import load_workload

        workload = load_workload(args.model, stages=stages, seed=args.seed)
        graph = capture(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn).graph
        strategy = _strategy(args)
        strategy = strategy if isinstance(strategy, Strategy) else strategy(stages)
    else:
        strategy = _strategy(args)
        strategy = strategy if isinstance(strategy, Strategy) else strategy(args.stages)
        graph = _schedule_graph(args, _placed_stages(strategy), microbatches=_microbatches(strategy, args.microbatches))
    started = time.perf_counter()
    placed = strategy.apply(graph)
    program = compile_program(placed)
    seconds = time.perf_counter() - started
    args.out.write_text(to_json(program))
    if args.torch_csv is not None:
        from piper_directives import strategy_to_torch_csv

        args.torch_csv.write_text(strategy_to_torch_csv(strategy))
        print(f"wrote {args.torch_csv} (torch pipelining schedule, compute actions)")
    print(graph_summary(placed).splitlines()[0])
    print(f"compiled {program.world_size} rank plans, {sum(len(p.instructions) for p in program.ranks)} "
          f"instructions in {seconds:.2f} s; wrote {args.out}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from piper_ir import Program, from_json, program_text
    from piper_scheduler import verify

    try:
        program = from_json(args.program.read_text())
    except OSError as err:
        raise ValueError(f"cannot read {args.program}: {err}") from None
    if not isinstance(program, Program):
        raise ValueError(f"{args.program} holds a {type(program).__name__}, not a Program")
    verify(program)
    counts = {}
    for plan in program.ranks:
        for ins in plan.instructions:
            counts[ins.kind.value] = counts.get(ins.kind.value, 0) + 1
    _say(args, program_text(program))
    _say(args, f"\n{program.world_size} ranks, {program.microbatches} microbatches, "
               f"{sum(counts.values())} instructions ({', '.join(f'{k}={v}' for k, v in sorted(counts.items()))}); "
               f"communicators: {', '.join(f'{c.id} ({c.traffic})' for c in program.communicators) or 'none'}; verified")
    return _report(args, program, str(args.program))


_COMMANDS = {"simulate": _simulate, "plan": _plan, "show": _show}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("rtol", "atol"):
        if getattr(args, name, 0) < 0:
            parser.error(f"--{name} must be >= 0")
    for name in ("pp", "microbatches", "steps", "dp", "tp", "ep"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name} must be >= 1")
    if getattr(args, "ep", 1) > 1 and getattr(args, "tp", 1) > 1:
        parser.error("--ep with --tp (tensor and expert parallelism in one strategy) is not supported yet")
    if getattr(args, "zero", 0) and getattr(args, "dp", 1) < 2 and getattr(args, "ep", 1) < 2:
        parser.error("--zero shards over data-parallel replicas: it needs --dp 2 or more (or --ep 2 or more, "
                     "whose group is data-parallel for the non-expert weights)")
    if getattr(args, "memory_budget_mb", None) is not None and args.memory_budget_mb <= 0:
        parser.error("--memory-budget-mb must be > 0")
    try:
        if args.command in _COMMANDS:
            return _COMMANDS[args.command](args)
        return _train(args) if args.command == "train" else _check(args)
    except (PiperError, ValueError) as err:
        print(f"piper {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"piper {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
