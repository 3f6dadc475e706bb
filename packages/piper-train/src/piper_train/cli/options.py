"""The ``piper`` command line: each option group defined once, added to the subcommands that
take it, and the checks argparse cannot express.

| group | options | subcommands |
| --- | --- | --- |
| model | --model (default lm) | train, check |
| pipeline | --schedule, --strategy, --pp, --stages, --microbatches | train, check, simulate, plan |
| parallelism | --dp, --zero, --tp, --ep | train, check |
| run | --memory-budget-mb, --optimizer, --lr, --seed, --address, --backend, --placement, --ranks-per-gpu, --timeout | train, check |
| summary | --json (a machine-readable summary; standard JSON: a NaN or infinite number is written as the string "NaN", "Infinity" or "-Infinity") | train, check |
| train | --steps, --on-nan | train |
| simulation | --cost, --json, --png, --trace | simulate, show |
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from piper_directives import SCHEDULES

Group = Callable[[argparse.ArgumentParser], None]


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="lm", help="mlp, transformer, lm, moe, or path/to/file.py:factory (default: lm). "
                   "A file is EXECUTED (like `python file.py`): name only files you trust")


def add_pipeline(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="pipeline schedule (default: 1f1b)")
    p.add_argument("--strategy", type=Path, help="a directive program (.json) or a torch.distributed.pipelining "
                   "schedule (.csv, one row of actions per rank); replaces --schedule/--pp/--microbatches")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (default: 2)")
    p.add_argument("--stages", type=int,
                   help="annotated regions of a built-in model (default: what the schedule places on --pp ranks)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default: 4)")


def add_parallelism(p: argparse.ArgumentParser) -> None:
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


def add_seed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)


def add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget-mb", type=float, default=None,
                   help="fail at compile time if the estimated memory per GPU (per rank on the CPU) exceeds this "
                        "many MiB")
    p.add_argument("--optimizer", default="adamw", choices=["sgd", "adam", "adamw"], help="(default: adamw)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 3e-3 for adam/adamw, 0.05 for sgd)")
    add_seed(p)
    p.add_argument("--address", help="an existing Ray cluster's address (host:port of its head, as `ray start --head` "
                   "prints; or 'auto'); default: start an embedded local cluster")
    p.add_argument("--backend", choices=["cpu", "cuda"], default=None,
                   help="where ranks run: cpu (gloo) or cuda (a GPU per rank, NCCL); default: cuda when the Ray "
                        "cluster has a GPU for every rank, else cpu (the choice is printed)")
    p.add_argument("--placement", choices=["pack", "spread"], default="pack",
                   help="ranks on as few nodes as possible (pack) or as many (spread); either way pipeline "
                        "neighbours and tensor-parallel groups share a node where they fit (default: pack)")
    p.add_argument("--ranks-per-gpu", type=int, default=1,
                   help="ranks sharing one GPU with --backend cuda (e.g. a multi-rank strategy checked on one "
                        "GPU; they talk through host memory, not NCCL) (default: 1)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a rank that makes no progress for this long stops the run (exit code 3), naming the rank, "
                        "the instruction it is stuck in and what its peers were doing (default: 60)")


def add_summary(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")


def add_simulation(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost", default="F=1,B=2,W=1", help="per-phase costs, e.g. F=1,B=2,W=1,FB=2.5,loss=0 (FB: an "
                   "overlapped F&B pair; default: F=1,B=2,W=1)")
    p.add_argument("--json", action="store_true", help="print makespan, per-rank busy and idle time as JSON")
    p.add_argument("--png", type=Path, help="write a Gantt chart of the simulated step (needs matplotlib)")
    p.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace of the simulated step")


def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--on-nan", choices=["stop", "skip-step", "continue"], default="stop",
                   help="a NaN or Inf loss or gradient: stop the run (exit code 3) naming the step, microbatch and "
                        "rank where it first appeared; skip-step: undo that step (parameters and optimizer state "
                        "exactly as before it; the workers keep a copy of that state) and go on; continue: keep "
                        "it (default: stop)")


def _add_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-6)


def _add_simulate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--segments-per-stage", type=int, default=1, help="segments in each region (default: 1)")


def _add_plan_source(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="mlp, transformer, lm, or path/to/file.py:factory: capture this model. "
                        "A file is EXECUTED (like `python file.py`): name only files you trust")
    source.add_argument("--synthetic", action="store_true", help="a synthetic chain of regions (default)")


def _add_plan_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--torch-csv", type=Path, help="also write the strategy's compute actions as a torch "
                   "pipelining schedule CSV (one row per rank)")
    add_seed(p)
    p.add_argument("--out", type=Path, required=True, help="where to write the program (piper-ir JSON)")


def _add_program(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", type=Path, help="a program written by 'piper plan'")


_TRAINING = (add_model, add_pipeline, add_parallelism, add_run, add_summary)

#: subcommand -> (help, its option groups in the order --help lists them)
SUBCOMMANDS: dict[str, tuple[str, tuple[Group, ...]]] = {
    "train": ("train a model with a strategy on Ray", (*_TRAINING, _add_train)),
    "check": ("compare a strategy with single-device training", (*_TRAINING, _add_check)),
    "simulate": ("simulate a schedule on a synthetic model (no torch work)",
                 (add_pipeline, _add_simulate, add_simulation)),
    "plan": ("compile a strategy to a program and save it as JSON", (add_pipeline, _add_plan_source, _add_plan_output)),
    "show": ("print a saved program as a rank x step grid, simulate it", (_add_program, add_simulation)),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="piper", description="Programmable distributed training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, groups) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=text)
        for add in groups:
            add(command)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check (a usage error, exit code 2, like argparse's own)."""
    for name in ("rtol", "atol"):
        if getattr(args, name, 0) < 0:
            parser.error(f"--{name} must be >= 0")
    for name in ("pp", "microbatches", "steps", "dp", "tp", "ep", "ranks_per_gpu"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if getattr(args, "ep", 1) > 1 and getattr(args, "tp", 1) > 1:
        parser.error("--ep with --tp (tensor and expert parallelism in one strategy) is not supported yet")
    if getattr(args, "zero", 0) and getattr(args, "dp", 1) < 2 and getattr(args, "ep", 1) < 2:
        parser.error("--zero shards over data-parallel replicas: it needs --dp 2 or more (or --ep 2 or more, "
                     "whose group is data-parallel for the non-expert weights)")
    if getattr(args, "timeout", 1.0) <= 0:
        parser.error("--timeout must be > 0 (seconds)")
    if getattr(args, "memory_budget_mb", None) is not None and args.memory_budget_mb <= 0:
        parser.error("--memory-budget-mb must be > 0")


def say(args: argparse.Namespace, text: str) -> None:
    """Progress and reports: on stdout, or on stderr when ``--json`` owns stdout."""
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def finite_json(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by the string ``"NaN"``,
    ``"Infinity"`` or ``"-Infinity"``: ``--json`` prints standard JSON, which has no such
    numbers (Python's ``json`` would write bare ``NaN``, which most parsers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def print_json(summary: dict[str, Any]) -> None:
    print(json.dumps(finite_json(summary), allow_nan=False))
