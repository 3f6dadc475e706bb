"""``piper train`` and ``piper check``: a strategy on Ray workers, and against single-device
training. Imports torch and ray (``piper_train.cli`` imports this module only for them)."""

from __future__ import annotations

import argparse
import time

from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.cli.options import print_json, say
from piper_train.cli.request import StrategyRequest, model_regions
from piper_train.trainer import Trainer
from piper_train.workload import load_workload


def _budget(args: argparse.Namespace) -> int | None:
    return None if args.memory_budget_mb is None else int(args.memory_budget_mb * 2**20)


def _optimizer(args: argparse.Namespace) -> OptimizerSpec:
    lr = args.lr if args.lr is not None else (0.05 if args.optimizer == "sgd" else 3e-3)
    return OptimizerSpec(args.optimizer, lr)


def train_command(args: argparse.Namespace) -> int:
    workload = load_workload(args.model, stages=model_regions(args), seed=args.seed)
    say(args, f"piper train: model {args.model}, {args.strategy or args.schedule}, pp={args.pp}, dp={args.dp}, "
              f"tp={args.tp}, ep={args.ep}, zero={args.zero}, microbatches={args.microbatches}, {args.steps} steps")
    started = time.perf_counter()
    with Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
                 StrategyRequest.from_args(args).for_trainer(), optimizer=_optimizer(args), address=args.address,
                 memory_budget_bytes=_budget(args), log=lambda text: say(args, text), backend=args.backend,
                 placement=args.placement, ranks_per_gpu=args.ranks_per_gpu, timeout_s=args.timeout,
                 on_nan=args.on_nan) as trainer:
        say(args, f"workers up after {time.perf_counter() - started:.1f} s")
        losses, times, skipped = [], [], []
        for step in range(args.steps):
            inputs, targets = workload.batches(step)
            t0 = time.perf_counter()
            result = trainer.step(inputs, targets)
            times.append(time.perf_counter() - t0)
            losses.append(result.loss)
            say(args, f"step {step + 1:>4}/{args.steps}  loss {result.loss:8.4f}  {times[-1] * 1000:7.1f} ms/step")
            if result.nonfinite is not None:
                skipped += [step + 1] if result.skipped else []
                say(args, f"step {step + 1}: {result.nonfinite}; "
                          + ("step skipped (parameters and optimizer state as before it)" if result.skipped
                             else "kept (--on-nan continue)"))
    steady = times[1:] or times
    summary = {
        "command": "train", "model": args.model, "schedule": None if args.strategy else args.schedule,
        "strategy": str(args.strategy) if args.strategy else None,
        "pp": len(trainer.program.ranks) // (trainer.program.replicas * args.tp),
        "dp": trainer.program.replicas // args.ep, "tp": args.tp, "ep": args.ep, "zero": args.zero,
        "microbatches": trainer.program.microbatches, "steps": args.steps, "losses": losses,
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "mean_step_seconds": sum(steady) / len(steady) if steady else None,
        "compile_seconds": trainer.compile_seconds, "skipped_steps": skipped,
    }
    if args.json:
        print_json(summary)
    elif losses:
        say(args, f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {summary['mean_step_seconds'] * 1000:.1f} ms/step")
    return 0


def check_command(args: argparse.Namespace) -> int:
    workload = load_workload(args.model, stages=model_regions(args), seed=args.seed)
    say(args, f"piper check: model {args.model}, {args.strategy or args.schedule}, pp={args.pp}, dp={args.dp}, "
              f"tp={args.tp}, ep={args.ep}, zero={args.zero}, microbatches={args.microbatches}, {args.steps} steps "
              "vs single-device training")
    report = run_check(workload, StrategyRequest.from_args(args).for_trainer(), steps=args.steps,
                       optimizer=_optimizer(args), rtol=args.rtol, atol=args.atol, address=args.address,
                       log=lambda s: say(args, s), memory_budget_bytes=_budget(args), backend=args.backend,
                       placement=args.placement, ranks_per_gpu=args.ranks_per_gpu, timeout_s=args.timeout)
    rows = {what: report.worst(what) for what in ("loss", "grad", "param")}
    for what, d in rows.items():
        say(args, f"largest {what:<5} difference: abs {d.abs:.3e}  rel {d.rel:.3e}  ({d.where})")
    verdict = "PASS" if report.ok else "FAIL"
    say(args, f"{verdict}: within rtol={args.rtol:g}, atol={args.atol:g}" if report.ok
        else f"{verdict}: differences exceed rtol={args.rtol:g}, atol={args.atol:g}")
    if args.json:
        print_json({"command": "check", "ok": report.ok, "steps": report.steps,
                    **{f"max_{w}_abs": d.abs for w, d in rows.items()},
                    **{f"max_{w}_rel": d.rel for w, d in rows.items()}})
    return 0 if report.ok else 1
