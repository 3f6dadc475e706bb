"""``piper tune --hardware`` and ``piper simulate --hardware``: plan for devices that are not
here (docs/planning.md). The model is counted on fake tensors (``tuning.census``), every
strategy priced in closed form (``tuning.planner``); ``simulate`` also runs the simulator on
the compiled schedule with the priced per-microbatch costs. Nothing is allocated or run.
Imports torch (for the census), not ray."""

from __future__ import annotations

import argparse
import time
from collections import Counter

from piper_scheduler import CHUNKS, CostModel, compile_program, simulate
from piper_train.cli.document import emit
from piper_train.cli.options import say
from piper_train.hardware import load_hardware
from piper_train.hf import is_hf
from piper_train.metrics import SCHEMA
from piper_train.tuning.planner import Plan, Planner, Setting, candidates, rank
from piper_train.tuning.space import Candidate

SEQ_LEN = 4096  # tokens per sequence when --seq-len is not given
#: Microbatch counts ``tune --hardware`` tries without --microbatch-range.
MICROBATCHES = "1-256"


def _setting(args: argparse.Namespace, devices: int) -> Setting:
    if args.model is None or not is_hf(args.model):
        raise ValueError(f"--hardware plans a Hugging Face decoder config: give --model hf:CONFIG (got "
                         f"{args.model or 'no --model'})")
    import torch

    from piper_train.tuning.census import hf_census  # torch and transformers: only here

    hardware = load_hardware(args.hardware)
    seq_len = args.seq_len or SEQ_LEN
    batch = args.batch_size or devices
    dtype = getattr(args, "precision", None) or "bf16"
    started = time.perf_counter()
    census = hf_census(args.model, seq_len, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    say(args, f"counted {args.model} on fake tensors in {time.perf_counter() - started:.1f} s: "
              f"{census.params / 1e9:.3g} B parameters, {census.layers} layers, "
              f"{census.model_flops() / 1e12:.3g} TFLOP per {seq_len}-token sequence (forward and backward)")
    budget = getattr(args, "memory_budget_mb", None)
    return Setting(census, hardware, devices, batch, dtype=dtype, optimizer=getattr(args, "optimizer", "adamw"),
                   budget_bytes=None if budget is None else int(budget * 2**20))


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f}"


def _row(k: int | str, p: Plan) -> str:
    mfu = "-" if p.mfu is None else f"{p.mfu:.1%}"
    return (f"{k:>3}  {p.candidate.label:<46} {p.step_seconds:>9.3f} {p.tokens_per_second:>11,.0f} "
            f"{_figure(p.tflops_per_device):>7} {mfu:>6} {p.bubble:>7.1%} {_gib(p.peak_bytes):>8}")


def _figure(x: float) -> str:
    """One decimal, or three significant digits below 10 (a CPU's TFLOP/s)."""
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


HEADER = (f"{'#':>3}  {'strategy':<46} {'step s':>9} {'tokens/s':>11} {'TFLOP/s':>7} {'MFU':>6} {'bubble':>7} "
          f"{'GiB/dev':>8}")


def tune_plan(args: argparse.Namespace, microbatches: tuple[int, ...] | None) -> int:
    """``piper tune --hardware``: rank every strategy (module doc)."""
    started = time.perf_counter()
    from piper_train.cli.tuning import _microbatches  # one parser of --microbatch-range

    counts = microbatches or _microbatches(MICROBATCHES)
    if args.tps is not None and min(args.tps) < 1:
        raise ValueError(f"--tp: degrees must be >= 1, got {min(args.tps)}")
    setting = _setting(args, args.devices)
    planner = Planner(setting)
    per_node = int(setting.hardware.planning("devices_per_node"))
    tps = args.tps or [t for t in range(1, per_node + 1) if args.devices % t == 0 and per_node % t == 0]
    recompute = {"none": (False,), "all": (True,), "search": (False, True)}[args.recompute or "search"]
    sp = {"none": (False,), "all": (True,), "search": (False, True)}[args.sp_search or "none"]
    cps = (1, *sorted(set(args.cps or ()) - {1}))
    for cp in cps:
        if cp < 1 or args.devices % cp:
            raise ValueError(f"--cp: degree {cp} does not divide --devices {args.devices}")
    space = candidates(args.devices, schedules=args.schedules, microbatches=counts, zeros=args.zero_levels, tps=tps,
                       pps=args.pp, recompute=recompute, sp=sp, cps=cps)
    plans = rank(planner.price(c) for c in space)
    fitting = [p for p in plans if p.fits]
    seconds = time.perf_counter() - started
    say(args, f"\n{len(space)} strategies for {args.devices} x {setting.hardware.name} ({setting.batch} sequences "
              f"of {setting.census.seq_len} tokens per step): {len(fitting)} fit in "
              f"{setting.budget / 2**30:.1f} GiB per device; planned in {seconds:.1f} s")
    say(args, HEADER)
    for k, p in enumerate(fitting[: args.top], 1):
        say(args, _row(k, p))
    if not fitting:
        smallest = min((p for p in plans if p.peak_bytes), key=lambda p: p.peak_bytes, default=None)
        reasons = Counter(p.reason for p in plans)
        raise ValueError(f"no strategy fits {setting.budget / 2**30:.1f} GiB per device"
                         + (f": the smallest needs {_gib(smallest.peak_bytes)} GiB ({smallest.candidate.label})"
                            if smallest else "") + f"; {'; '.join(r for r, _ in reasons.most_common(3))}")
    reasons = Counter(p.reason.split(",")[0] for p in plans if not p.fits and not p.peak_bytes)
    if reasons:
        say(args, "\ncannot run (count, why):")
        for reason, count in reasons.most_common(args.top):
            say(args, f"  {count:>5}  {reason}")
    say(args, f"\nbest: {fitting[0].candidate.label}: {fitting[0].step_seconds:.3f} s per step predicted, "
              f"MFU {fitting[0].mfu:.1%}, {_gib(fitting[0].peak_bytes)} GiB per device")
    if args.json:
        emit(args, {"schema": SCHEMA, "command": "tune", "model": args.model, "hardware": setting.hardware.name,
                    "devices": args.devices, "batch": setting.batch, "seq_len": setting.census.seq_len,
                    "parameters": setting.census.params, "model_flops_per_sequence": setting.census.model_flops(),
                    "space": len(space), "fit": len(fitting), "seconds": seconds, "best": fitting[0].as_dict(),
                    "ranking": [p.as_dict() for p in fitting[: args.top]]})
    return 0


def simulate_plan(args: argparse.Namespace) -> int:
    """``piper simulate --hardware``: one strategy priced, and its pipeline simulated."""
    if args.strategy is not None:
        raise ValueError("--strategy with --hardware: give the strategy as --schedule, --pp, --tp, --sp, --cp, "
                         "--zero, --microbatches, --recompute")
    if args.devices is None:
        raise ValueError("--hardware needs --devices (pp x tp x cp x data-parallel replicas)")
    if args.plan_cp < 1:
        raise ValueError(f"--cp must be >= 1, got {args.plan_cp}")
    if args.plan_sp and args.tp < 2:
        raise ValueError("--sp: sequence parallelism shards the code between tensor-parallel regions; it needs --tp >= 2")
    if args.plan_cp > 1 and args.tp > 1:
        raise ValueError("--cp with --tp: context parallelism with tensor parallelism is not supported")
    if args.devices % (args.pp * args.tp * args.plan_cp):
        raise ValueError(f"--devices {args.devices} is not a multiple of --pp {args.pp} x --tp {args.tp} x --cp "
                         f"{args.plan_cp}")
    dp = args.devices // (args.pp * args.tp * args.plan_cp)
    from piper_train.cli.scheduling import check_size  # the simulated schedule's size limit

    check_size(args, args.pp * CHUNKS.get(args.schedule, 1), args.microbatches)
    setting = _setting(args, args.devices)
    candidate = Candidate(args.schedule, args.pp, args.microbatches, dp, args.tp, 1, args.plan_zero, None,
                          args.plan_recompute == "all", args.plan_sp, args.plan_cp)
    plan = Planner(setting).price(candidate)
    if not plan.peak_bytes:
        raise ValueError(f"{candidate.label} cannot run: {plan.reason}")
    simulated = _simulated(candidate, plan)
    total = simulated + plan.parts["dp_exposed"] + plan.parts["optimizer"]
    say(args, HEADER)
    say(args, _row("", plan))
    say(args, f"pipeline: {plan.parts['pipeline']:.3f} s in closed form, {simulated:.3f} s simulated on the compiled "
              f"schedule (step {total:.3f} s); per microbatch on the slowest rank F {plan.parts['F'] * 1e3:.1f} ms, "
              f"BI {plan.parts['BI'] * 1e3:.1f} ms, BW {plan.parts['BW'] * 1e3:.1f} ms; exposed data-parallel "
              f"traffic {plan.parts['dp_exposed'] * 1e3:.1f} ms, optimizer {plan.parts['optimizer'] * 1e3:.1f} ms")
    if plan.reason:
        say(args, f"does not fit: {plan.reason}")
    if args.json:
        emit(args, {"schema": SCHEMA, "command": "simulate", "model": args.model, "hardware": setting.hardware.name,
                    "devices": args.devices, "batch": setting.batch, "seq_len": setting.census.seq_len,
                    **plan.as_dict(), "simulated_pipeline_seconds": simulated, "simulated_step_seconds": total})
    return 0


CALIBRATED = "calibrated.json"  # where --calibrate writes without --out


def calibrate(args: argparse.Namespace) -> int:
    """``piper tune --calibrate``: measure this machine and write its hardware file
    (``piper_train.tuning.calibrate``); ``--hardware`` gives the fields not measured."""
    import json
    from pathlib import Path

    import torch

    from piper_train.cli.outputs import writing
    from piper_train.hardware import parse_hardware
    from piper_train.tuning.calibrate import (
        ELEMENTS,
        Calibration,
        fit_step,
        hardware_file,
        measure,
        model_matmuls,
    )

    if args.devices < 1:
        raise ValueError(f"--devices {args.devices}: calibration measures 1 or more ranks")
    base = None if args.hardware is None else load_hardware(args.hardware)
    dtype = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    matmuls: tuple[tuple[int, int, int], ...] = ()
    elements = ELEMENTS
    census = None
    seq_len, sequences = args.seq_len or SEQ_LEN, args.batch_size or 1  # --batch-size: sequences per microbatch
    runtime = getattr(args, "calibrate_runtime", None) or "local"
    if args.model is not None and args.model != "lm":  # "lm": add_model's default, no sizes to take
        if not is_hf(args.model):
            raise ValueError(f"--calibrate measures the products of a Hugging Face config's sizes: give --model "
                             f"hf:CONFIG or leave --model out (got {args.model})")
        if dtype not in ("fp32", "bf16"):
            raise ValueError(f"--precision {dtype}: --calibrate --model fits the planner, which plans in fp32 or bf16")
        from piper_train.tuning.census import hf_census, hf_config

        config = hf_config(args.model)
        tokens = seq_len * sequences
        matmuls = model_matmuls(config, tokens)
        elements = tokens * max(k for _, k, _ in matmuls[:-1])  # the MLP's widest activation
        census = hf_census(args.model, seq_len, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    # >= 0: options.MINIMUMS
    timing = Calibration.timed_for(args.calibrate_seconds) if args.calibrate_seconds is not None else {}
    cal = Calibration(devices=args.devices, dtype=dtype, matmuls=matmuls, elementwise_elements=elements,
                      model=args.model if census is not None else None, seq_len=seq_len, sequences=sequences,
                      runtime=runtime, **timing)
    out = args.out or Path(CALIBRATED)
    say(args, f"piper tune --calibrate: {dtype} on {'cuda' if torch.cuda.is_available() else 'cpu'}, "
              f"{args.devices} rank(s) at once, {len(matmuls) or 1} product shape(s)")
    measured = measure(cal)
    data = hardware_file(measured, cal, base, name=out.stem)
    fit = None
    if census is not None:  # the model's own step: fit the planner's figures to it
        fit = fit_step(census, parse_hardware(data, str(out)), measured.steps, dtype, measured.step_ranks,
                       measured.tp_step, measured.zero_step)
        data = hardware_file(measured, cal, base, name=out.stem, fit=fit)
    with writing(out, "--out"):
        out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    load_hardware(str(out))  # what --hardware will read: refused here rather than there
    say(args, f"peak {measured.peak_flops / 1e12:.4g} TFLOP/s {dtype}; the model's products reach "
              f"{measured.flop_efficiency:.0%} of it; elementwise {measured.bandwidth / 1e9:.3g} GB/s; "
              f"{measured.op_overhead * 1e6:.1f} us per one-element operator"
              + (f"; link {measured.link_bandwidth / 1e9:.3g} GB/s, {measured.link_latency * 1e6:.0f} us"
                 if measured.link_bandwidth and measured.link_latency else "; links not measured")
              + f" (load average {'?' if measured.load is None else f'{measured.load:.1f}'}, "
                f"{measured.seconds:.1f} s)")
    if fit is not None:
        what = (f"Piper's training step on {cal.devices} data-parallel {runtime} rank(s)" if measured.step_ranks
                else "the model's captured forward, loss and backward")
        say(args, f"{what}: "
                  + ", ".join(f"{b} sequence(s) {t * 1e3:.1f} ms" for b, t in fit.steps)
                  + f"; fitted: flop_efficiency {fit.flop_efficiency:.3f} "
                    f"({fit.flop_efficiency * (fit.peak_flops or measured.peak_flops) / 1e9:.3g} GFLOP/s), "
                    f"{fit.op_overhead * 1e6:.2f} us per operator x {fit.operators} operators"
                  + ("" if fit.exact else " (no figures in range reproduce both: the larger fitted)")
                  + ("" if fit.link_latency is None or fit.tensor_parallel is None else
                     f"; on {cal.devices} tensor-parallel rank(s): {fit.tensor_parallel[1] * 1e3:.1f} ms, a collective "
                     f"inside the step {fit.link_latency * 1e6:.0f} us")
                  + ("" if fit.scatter_gather_factor is None or fit.sharded is None else
                     f"; with ZeRO-1: {fit.sharded[1] * 1e3:.1f} ms, a reduce-scatter or all-gather "
                     f"{fit.scatter_gather_factor:.2f}x the ring's time"))
    say(args, f"wrote {out}; plan with it: piper tune --hardware {out} --precision {dtype} --devices N "
              f"--model hf:CONFIG")
    if args.json:
        emit(args, {"schema": SCHEMA, "command": "tune", "calibrate": True, "out": str(out), "hardware": data,
                    "seconds": measured.seconds, "load_average": measured.load, "runtime": runtime,
                    "step": None if fit is None else {
                        "sequences": [b for b, _ in fit.steps], "seconds": [t for _, t in fit.steps],
                        "flop_efficiency": fit.flop_efficiency, "op_overhead_us": fit.op_overhead * 1e6,
                        "operators": fit.operators, "exact": fit.exact,
                        "tensor_parallel": None if fit.tensor_parallel is None else {
                            "sequences": fit.tensor_parallel[0], "seconds": fit.tensor_parallel[1],
                            "link_latency_us": fit.link_latency * 1e6 if fit.link_latency is not None else None},
                        "zero1": None if fit.sharded is None else {
                            "sequences": fit.sharded[0], "seconds": fit.sharded[1],
                            "scatter_gather_factor": fit.scatter_gather_factor}}})
    return 0


def _simulated(candidate: Candidate, plan: Plan) -> float:
    """The compiled schedule's makespan under the slowest rank's priced costs (each stage
    costs it, the loss nothing, every transfer one hop)."""
    from piper_directives import build_schedule, synthetic_graph

    v = CHUNKS[candidate.schedule]
    chunks = candidate.pp * v
    graph = synthetic_graph(chunks, candidate.microbatches, 1, hidden=1, batch=1)
    program = compile_program(build_schedule(candidate.schedule, candidate.pp, candidate.microbatches,
                                             stages=chunks).apply(graph))
    f, bi, bw = (plan.parts[k] / v for k in ("F", "BI", "BW"))
    zero = dict.fromkeys(("F", "B", "BI", "BW"), 0.0)
    costs = CostModel(F=f, B=bi + bw, BI=bi, BW=bw, latency=plan.parts["hop"], overrides={"loss": zero})
    return simulate(program, costs).makespan


__all__ = ["calibrate", "simulate_plan", "tune_plan"]
