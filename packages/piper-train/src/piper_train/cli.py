"""The ``piper`` command: ``piper train`` and ``piper check``."""

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
    p.add_argument("--model", default="lm", help="mlp, transformer, lm, or path/to/file.py:factory (default: lm)")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="pipeline schedule (default: 1f1b)")
    p.add_argument("--strategy", type=Path, help="a JSON directive program; replaces --schedule/--pp/--microbatches")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (default: 2)")
    p.add_argument("--stages", type=int, help="annotated regions of a built-in model (default: --pp)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default: 4)")
    p.add_argument("--optimizer", default="adamw", choices=["sgd", "adam", "adamw"], help="(default: adamw)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 3e-3 for adam/adamw, 0.05 for sgd)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", help="Ray cluster address; default: start an embedded local cluster")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")


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
    return parser


def _strategy(args: argparse.Namespace):  # noqa: ANN202
    if args.strategy is not None:
        return Strategy.from_json(args.strategy.read_text(), source=str(args.strategy))

    def build(stages: int) -> Strategy:
        return build_schedule(args.schedule, args.pp, args.microbatches, stages=stages)

    return build


def _optimizer(args: argparse.Namespace) -> OptimizerSpec:
    lr = args.lr if args.lr is not None else (0.05 if args.optimizer == "sgd" else 3e-3)
    return OptimizerSpec(args.optimizer, lr)


def _say(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def _train(args: argparse.Namespace) -> int:
    from piper_train.trainer import Trainer
    from piper_train.workload import load_workload

    workload = load_workload(args.model, stages=args.stages or args.pp, seed=args.seed)
    _say(args, f"piper train: model {args.model}, {args.strategy or args.schedule}, pp={args.pp}, "
               f"microbatches={args.microbatches}, {args.steps} steps")
    started = time.perf_counter()
    with Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
                 _strategy(args), optimizer=_optimizer(args), address=args.address) as trainer:
        _say(args, f"compiled {len(trainer.program.ranks)} rank plans in {trainer.compile_seconds:.2f} s; "
                   f"workers up after {time.perf_counter() - started:.1f} s")
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
        "strategy": str(args.strategy) if args.strategy else None, "pp": len(trainer.program.ranks),
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

    workload = load_workload(args.model, stages=args.stages or args.pp, seed=args.seed)
    _say(args, f"piper check: model {args.model}, {args.strategy or args.schedule}, pp={args.pp}, "
               f"microbatches={args.microbatches}, {args.steps} steps vs single-device training")
    report = run_check(workload, _strategy(args), steps=args.steps, optimizer=_optimizer(args),
                       rtol=args.rtol, atol=args.atol, address=args.address, log=lambda s: _say(args, s))
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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _train(args) if args.command == "train" else _check(args)
    except (PiperError, ValueError) as err:
        print(f"piper {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"piper {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
