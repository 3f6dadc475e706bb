"""``piper train`` and ``piper check``: a strategy on Ray workers, and against single-device
training. Imports torch and ray (``piper_train.cli`` imports this module only for them)."""

from __future__ import annotations

import argparse
import json
import time

from piper_runtime import OptimizerSpec
from piper_train.check import TOLERANCES, run_check
from piper_train.cli.options import say
from piper_train.cli.request import StrategyRequest, model_regions
from piper_train.trainer import Trainer
from piper_train.workload import load_workload


def _budget(args: argparse.Namespace) -> int | None:
    return None if args.memory_budget_mb is None else int(args.memory_budget_mb * 2**20)


def _optimizer(args: argparse.Namespace) -> OptimizerSpec:
    lr = args.lr if args.lr is not None else (0.05 if args.optimizer == "sgd" else 3e-3)
    return OptimizerSpec(args.optimizer, lr)


def _header(args: argparse.Namespace, request: StrategyRequest) -> str:
    """What runs: the strategy's own pipeline ranks and microbatches (a ``--strategy`` file
    says them, not ``--pp``/``--microbatches``), the parallelisms and the precision."""
    pp, microbatches = request.shape()
    precision = f", precision={args.precision}" if args.precision else ""
    return (f"model {args.model}, {request.name}, pp={pp}, dp={args.dp}, tp={args.tp}, ep={args.ep}, "
            f"zero={args.zero}, microbatches={microbatches}{precision}, {args.steps} steps")


def train_command(args: argparse.Namespace) -> int:
    workload = load_workload(args.model, stages=model_regions(args), seed=args.seed)
    request = StrategyRequest.from_args(args)
    say(args, f"piper train: {_header(args, request)}")
    started = time.perf_counter()
    with Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
                 request.for_trainer(), optimizer=_optimizer(args), address=args.address,
                 memory_budget_bytes=_budget(args), log=lambda text: say(args, text), seed=args.seed,
                 precision=args.precision) as trainer:
        say(args, f"workers up after {time.perf_counter() - started:.1f} s")
        losses, times = [], []
        for step in range(args.steps):
            inputs, targets = workload.batches(step)
            t0 = time.perf_counter()
            result = trainer.step(inputs, targets)
            times.append(time.perf_counter() - t0)
            losses.append(result.loss)
            say(args, f"step {step + 1:>4}/{args.steps}  loss {result.loss:8.4f}  {times[-1] * 1000:7.1f} ms/step")
    steady = times[1:] or times
    summary = {
        "command": "train", "model": args.model, "schedule": None if args.strategy else args.schedule,
        "strategy": str(args.strategy) if args.strategy else None,
        "pp": len(trainer.program.ranks) // (trainer.program.replicas * args.tp),
        "dp": trainer.program.replicas // args.ep, "tp": args.tp, "ep": args.ep, "zero": args.zero,
        "microbatches": trainer.program.microbatches, "steps": args.steps, "losses": losses,
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "mean_step_seconds": sum(steady) / len(steady) if steady else None,
        "compile_seconds": trainer.compile_seconds,
    }
    if args.json:
        print(json.dumps(summary))
    elif losses:
        say(args, f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {summary['mean_step_seconds'] * 1000:.1f} ms/step")
    return 0


def check_command(args: argparse.Namespace) -> int:
    workload = load_workload(args.model, stages=model_regions(args), seed=args.seed)
    request = StrategyRequest.from_args(args)
    say(args, f"piper check: {_header(args, request)} vs single-device training")
    rtol, atol = TOLERANCES[args.precision or "fp32"]
    args.rtol = rtol if args.rtol is None else args.rtol
    args.atol = atol if args.atol is None else args.atol
    report = run_check(workload, request.for_trainer(), steps=args.steps,
                       optimizer=_optimizer(args), rtol=args.rtol, atol=args.atol, address=args.address,
                       log=lambda s: say(args, s), memory_budget_bytes=_budget(args), seed=args.seed,
                       precision=args.precision)
    rows = {what: report.worst(what) for what in ("loss", "grad", "param")}
    for what, d in rows.items():
        say(args, f"largest {what:<5} difference: abs {d.abs:.3e}  rel {d.rel:.3e}  ({d.where})")
    verdict = "PASS" if report.ok else "FAIL"
    say(args, f"{verdict}: within rtol={args.rtol:g}, atol={args.atol:g}" if report.ok
        else f"{verdict}: differences exceed rtol={args.rtol:g}, atol={args.atol:g}")
    if args.json:
        print(json.dumps({"command": "check", "ok": report.ok, "steps": report.steps,
                          **{f"max_{w}_abs": d.abs for w, d in rows.items()},
                          **{f"max_{w}_rel": d.rel for w, d in rows.items()}}))
    return 0 if report.ok else 1
