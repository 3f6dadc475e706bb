"""``piper tune``: profile a model, search the strategy space, print the ranking, write the
best strategy, optionally run the top K (``piper_train.tuning``). Imports torch and ray
(``piper_train.cli`` imports this module only for ``tune``)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable

from piper_runtime import OptimizerSpec, shutdown
from piper_train.cli.document import emit
from piper_train.cli.options import say
from piper_train.cli.outputs import writing
from piper_train.metrics import SCHEMA
from piper_train.tuning.api import Measured, TuneReport, built_regions, tune, validate
from piper_train.tuning.profiler import DEFAULT_CACHE
from piper_train.tuning.search import DOMINATED, INVALID, OVER_BUDGET, Evaluation
from piper_train.weights import load_weights
from piper_train.workload import load_workload


def _progress(args: argparse.Namespace) -> Callable[[int], Callable[[Evaluation], None]]:
    """A tqdm bar over the candidates on stderr (off with --no-progress-bar or off a terminal)."""

    def start(total: int) -> Callable[[Evaluation], None]:
        import tqdm

        bar = tqdm.tqdm(total=total, desc="search", unit="strategy", file=sys.stderr, dynamic_ncols=True,
                        disable=True if args.no_progress_bar else None, leave=False)

        def hear(_: Evaluation) -> None:
            bar.update(1)
            if bar.n >= total:
                bar.close()

        return hear

    return start


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


def _table(args: argparse.Namespace, report: TuneReport) -> None:
    result = report.result
    fitting = result.fitting
    say(args, f"\n{report.space} strategies for {report.devices} devices ({report.regions} regions): "
              f"{len(fitting)} fit, {result.count(OVER_BUDGET)} over the memory budget, "
              f"{result.count(INVALID)} cannot run"
              + (f", {result.count(DOMINATED)} cannot enter the top {max(args.top, args.validate, 1)} (not compiled)"
                 if result.count(DOMINATED) else "")
              + f"; searched in {result.seconds:.1f} s")
    say(args, f"{'#':>3}  {'strategy':<52} {'predicted ms':>12} {'peak MiB/rank':>13} {'bubble':>7}")
    for k, e in enumerate(fitting[: args.top], 1):
        say(args, f"{k:>3}  {e.candidate.label:<52} {e.predicted * 1e3:>12.2f} {_mib(e.peak_bytes):>13} "
                  f"{e.bubble:>7.1%}")
    over = [e for e in result.evaluations if e.status == OVER_BUDGET]
    if over:
        say(args, f"\nover the budget of {report.budget_bytes / 2**20:.2f} MiB per rank (smallest first):")
        for e in over[: args.top]:
            say(args, f"     {e.candidate.label:<52} {'-':>12} {_mib(e.peak_bytes):>13}  {e.reason}")
    reasons = Counter(e.reason for e in result.evaluations if e.status == INVALID)
    if reasons:
        say(args, "\ncannot run (count, why):")
        for reason, count in reasons.most_common(args.top):
            say(args, f"  {count:>4}  {reason}")


def _validation(args: argparse.Namespace, rows: list[Measured]) -> None:
    say(args, f"\nvalidation on the runtime ({args.validate_steps} timed steps each, median):")
    say(args, f"{'#':>3}  {'strategy':<52} {'predicted ms':>12} {'measured ms':>12} {'ratio':>6} {'peak MiB':>9}")
    for k, m in enumerate(rows, 1):
        e = m.evaluation
        if m.seconds is None:
            say(args, f"{k:>3}  {e.candidate.label:<52} {e.predicted * 1e3:>12.2f}  failed: {m.error}")
            continue
        say(args, f"{k:>3}  {e.candidate.label:<52} {e.predicted * 1e3:>12.2f} {m.seconds * 1e3:>12.2f} "
                  f"{m.seconds / e.predicted:>6.2f} {_mib(max(m.peak_bytes, default=None)):>9}")


def _microbatches(text: str) -> tuple[int, ...]:
    """``1,2,4,8`` as given, or ``LO-HI``: the powers of two from LO to HI."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            if lo < 1 or hi < lo:
                raise ValueError
            out, m = [], 1
            while m <= hi:
                if m >= lo:
                    out.append(m)
                m *= 2
            return tuple(out)
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"--microbatch-range: expected LO-HI (powers of two) or a list like 1,2,4,8; got {text!r}")
    return values


def _recompute(choice: str | None, budget: int | None) -> tuple[bool, ...]:
    """The recomputation choices ``--recompute`` asks for (by default searched only under a
    budget: without one it never wins, being the same step plus a forward)."""
    choice = choice or ("search" if budget is not None else "none")
    return {"none": (False,), "all": (True,), "search": (False, True)}[choice]


def _sp_choices(choice: str | None) -> tuple[bool, ...]:
    """The sequence-parallel choices ``--sp`` asks for (default none: each tp degree searched
    with it is one more variant to profile)."""
    return {"none": (False,), "all": (True,), "search": (False, True)}[choice or "none"]


def _cp_degrees(cps: list[int] | None, devices: int) -> tuple[int, ...]:
    """The context-parallel degrees ``--cp`` asks for (each dividing ``--devices``), and 1."""
    for cp in cps or ():
        if cp < 1 or devices % cp:
            raise ValueError(f"--cp: degree {cp} does not divide --devices {devices}")
    return (1, *sorted(set(cps or ()) - {1}))


def tune_command(args: argparse.Namespace) -> int:
    if args.calibrate_runtime is not None and not args.calibrate:
        raise ValueError("--runtime with tune: the runtime --calibrate times the model's step as; without "
                         "--calibrate, tune profiles on Ray")
    if args.calibrate_seconds is not None and not args.calibrate:
        raise ValueError("--calibrate-seconds: how long --calibrate times each figure; without --calibrate nothing "
                         "is calibrated")
    if args.calibrate:  # measure this machine into a hardware file (cli.planning)
        from piper_train.cli.planning import calibrate

        return calibrate(args)
    if args.hardware is not None:  # plan for hardware that need not be here (cli.planning)
        from piper_train.cli.planning import tune_plan

        return tune_plan(args, None if args.microbatch_range is None else _microbatches(args.microbatch_range))
    if args.tps is not None:
        raise ValueError("--tp lists the tensor-parallel degrees --hardware plans; without --hardware, tune "
                         "searches every degree the model can be cut to")
    if args.precision is not None:
        raise ValueError("--precision is the dtype --hardware plans in and --calibrate measures in; without them, "
                         "tune profiles the model in its own dtypes")
    microbatches = _microbatches(args.microbatch_range or "1-16")
    comm = None
    if (args.latency_us is None) != (args.bandwidth_mbs is None):
        raise ValueError("--latency-us and --bandwidth-mbs give the link together; give both or neither")
    if args.latency_us is not None:
        comm = (args.latency_us * 1e-6, args.bandwidth_mbs * 2**20)
    budget = None if args.memory_budget_mb is None else int(args.memory_budget_mb * 2**20)
    optimizer = OptimizerSpec(args.optimizer, 1e-3)
    say(args, f"piper tune: model {args.model}, {args.devices} devices, microbatches {list(microbatches)}, "
              f"schedules {', '.join(args.schedules)}" + (f", budget {args.memory_budget_mb:g} MiB" if budget else ""))
    try:
        model = load_workload(args.model, stages=built_regions(args.stages, args.devices), seed=args.seed,
                              regions=args.regions, capture=args.capture, data=args.data, tokenizer=args.tokenizer,
                              seq_len=args.seq_len)
        if args.init_from is not None:
            load_weights(model.model, args.init_from)
        report = tune(model, args.devices, stages=args.stages, memory_budget_bytes=budget,
                      microbatches=microbatches, schedules=args.schedules, zeros=args.zero_levels, pps=args.pp,
                      recompute=_recompute(args.recompute, budget), sp=_sp_choices(args.sp_search),
                      cps=_cp_degrees(args.cps, args.devices),
                      optimizer=optimizer, backend=args.backend, address=args.address,
                      cache_dir=None if args.no_cache else (args.cache_dir or DEFAULT_CACHE), comm=comm,
                      profile_steps=args.profile_steps, seed=args.seed,
                      keep=None if args.exhaustive else max(args.top, args.validate, 1), progress=_progress(args),
                      log=lambda s: say(args, s))
        _table(args, report)
        best = report.best
        if best is None:  # tune raises first; kept for the type checker
            raise ValueError("no strategy fits")
        say(args, f"\nbest: {best.candidate.label}: {best.predicted * 1e3:.2f} ms per step predicted, "
                  f"{_mib(best.peak_bytes)} MiB per rank")
        if args.out is not None:
            with writing(args.out, "--out"):
                report.write(args.out)
            say(args, f"wrote {args.out}; run it with: piper train --model {args.model} --strategy {args.out}")
        rows = validate(report, model, args.validate, steps=args.validate_steps, optimizer=optimizer,
                        backend=args.backend, address=args.address, seed=args.seed) if args.validate else []
        if rows:
            _validation(args, rows)
    finally:
        shutdown()
    if args.json:
        emit(args, {
            "schema": SCHEMA, "command": "tune", "model": args.model, "devices": args.devices,
            "regions": report.regions, "space": report.space, "search_seconds": report.result.seconds,
            "profile_seconds": report.profile_seconds, "best": best.as_dict(),
            "ranking": [e.as_dict() for e in report.result.evaluations],
            "validation": [{"strategy": m.evaluation.candidate.label, "predicted_seconds": m.evaluation.predicted,
                            "measured_seconds": m.seconds, "peak_bytes": list(m.peak_bytes), "error": m.error}
                           for m in rows],
        })
    return 0


__all__ = ["DEFAULT_CACHE", "tune_command"]
