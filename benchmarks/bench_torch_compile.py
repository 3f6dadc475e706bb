"""``--compile`` against eager: the same model, schedule, optimizer and runtime, alternated.

Each round builds a Trainer eagerly and one with ``compile=BACKEND`` (alternating which goes
first), runs one set-up step (the first: capture is done, so it holds the ranks' compiling
of their segments, and on the first compiled round inductor's cold cache; later rounds
and later runs read inductor's on-disk cache) and then ``--steps`` steps one in flight ahead
(``stepping.pipelined``, as ``fit`` runs them; the first of them, a second warm-up, is not
counted). It prints per round the set-up step and the median steady-state step of both, and
their ratio, with the ``local`` runtime (the default: ranks are threads of this process, each
op on one thread as a Ray actor's) also the process's CPU time per steady step, which other
jobs on the machine sway less; then the medians of the ratios. The
optimizer is AdamW, torch's implementation ``--optimizer-impl`` (default: the fused kernel).

``--split-cost`` also times one stage segment's compiled ``B`` against its ``BI`` then ``BW``
(the split backward of zero-bubble schedules, piper_runtime.rank.compiled), and eager
autograd's ``B`` against its ``BI`` (``autograd.grad``, graph retained) then ``BW``: the
median of ``--reps`` calls each.

    .venv/bin/python benchmarks/bench_torch_compile.py [--model stack] [--schedule 1f1b] [--pp 2]
        [--microbatches 8] [--steps 12] [--rounds 2] [--backend inductor] [--runtime local]
        [--split-cost] [--reps 30]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
from stepping import cpu_seconds, pipelined, trainer_arguments

from piper_directives import capture
from piper_runtime import OptimizerSpec
from piper_runtime.rank.compiled import CompiledSegment, CompileStats
from piper_runtime.rank.process import TORCH_THREADS
from piper_train.models import build_model
from piper_train.trainer import Trainer


def run(spec, args, compile: str | None) -> tuple[float, float, float | None]:
    """(the set-up step's seconds, the median steady-state step's seconds, and with the
    ``local`` runtime the process's CPU seconds per steady step: less swayed by other jobs)."""
    optimizer = OptimizerSpec("adamw", 1e-3, implementation=args.optimizer_impl)
    with Trainer.with_schedule(
        spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, schedule=args.schedule, pp=args.pp,
        microbatches=args.microbatches, optimizer=optimizer, runtime=args.runtime, compile=compile,
        timeout_s=600.0,
    ) as trainer:
        batches = [spec.batches(s) for s in range(args.steps + 2)]
        started = time.perf_counter()
        trainer.step(*batches[0])
        setup = time.perf_counter() - started
        trainer.step(*batches[1])
        cpu = cpu_seconds(os.getpid())
        stepped = pipelined(trainer, batches[2:])
        cpu = (cpu_seconds(os.getpid()) - cpu) / len(stepped) if args.runtime == "local" else None
    return setup, statistics.median(seconds for seconds, _ in stepped[1:]), cpu


def split_cost(spec, args) -> None:
    """Compiled B vs BI + BW, and eager's, on the first stage's module (module doc), on one
    thread (as a rank runs: ``TORCH_THREADS``)."""
    torch.set_num_threads(TORCH_THREADS)
    captured = capture(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn)
    seg = next(s for s in captured.graph.segments if s.role.value == "stage")
    modules = captured.modules
    module = modules[seg.id]
    (x,), _ = spec.batches(0)
    x = x[: x.shape[0] // args.microbatches]
    out = module(x)
    g = torch.randn_like(out if isinstance(out, torch.Tensor) else out[0])

    # Eager: B, and BI (autograd.grad, graph kept) then BW (backward to the parameters).
    params = [p for p in module.parameters() if p.requires_grad]

    def eager(split: bool):
        def step():
            a = x.detach().requires_grad_(True)
            out = module(a)
            out = out if isinstance(out, torch.Tensor) else out[0]
            if split:
                torch.autograd.grad(out, [a], g, retain_graph=True)
                torch.autograd.backward(out, g, inputs=params)
            else:
                out.backward(g)
            module.zero_grad(set_to_none=True)
        return step

    fn = CompiledSegment(seg.id, module, [x], [True], args.backend, CompileStats())
    tangents = fn.tangents([g])
    _, residuals = fn.forward([x])
    fn.backward_input(list(residuals), tangents)  # compile BI and BW before timing

    def compiled(split: bool):
        def step():
            _, residuals = fn.forward([x])
            if split:
                _, pending = fn.backward_input(list(residuals), tangents)
                fn.backward_weight(pending)
            else:
                fn.backward(list(residuals), tangents)
        return step

    steps = {
        "eager F+B": eager(False), "eager F+BI+BW": eager(True),
        f"{args.backend} F+B": compiled(False), f"{args.backend} F+BI+BW": compiled(True),
    }
    for warm in steps.values():
        warm()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.reps):  # the four alternate, so a busy moment hits each alike
        for name, call in steps.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    print(f"split backward, segment {seg.id} of {args.model} (one microbatch of {tuple(x.shape)}), "
          f"{args.reps} calls each, alternating, on {torch.get_num_threads()} thread(s); min (median):")
    for name, t in times.items():
        print(f"  {name:<20} {min(t) * 1e3:8.2f} ms ({statistics.median(t) * 1e3:.2f})")
    low = {name: min(t) for name, t in times.items()}
    b = args.backend
    print(f"  by the minimum: F+BI+BW / F+B: eager {low['eager F+BI+BW'] / low['eager F+B']:.3f}, {b} "
          f"{low[f'{b} F+BI+BW'] / low[f'{b} F+B']:.3f}; {b} / eager: F+B "
          f"{low[f'{b} F+B'] / low['eager F+B']:.3f}, F+BI+BW {low[f'{b} F+BI+BW'] / low['eager F+BI+BW']:.3f}")


def main() -> None:
    parser = trainer_arguments(__doc__.splitlines()[0], model="stack", steps=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--runtime", default="local")
    parser.add_argument("--optimizer-impl", default="auto", choices=["auto", "fused", "foreach", "for-loop"])
    parser.add_argument("--split-cost", action="store_true")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    if args.runtime == "local":
        torch.set_num_threads(TORCH_THREADS)  # as a Ray actor rank runs (the ranks share this process)
    spec = build_model(args.model, stages=args.pp)
    print(f"--compile {args.backend} vs eager: {args.model}, {args.schedule}, pp={args.pp}, {args.microbatches} "
          f"microbatches, AdamW (implementation {args.optimizer_impl}), runtime {args.runtime}; "
          f"{args.steps} steady steps per run; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'round':>5} {'eager setup s':>13} {'eager ms':>9} {'cpu ms':>7} {'compiled setup s':>16} "
          f"{'compiled ms':>11} {'cpu ms':>7} {'compiled/eager':>15} {'cpu':>6}")
    ratios, cpu_ratios = [], []
    for r in range(args.rounds):
        result = {}
        for mode in (None, args.backend) if r % 2 == 0 else (args.backend, None):
            result[mode] = run(spec, args, mode)
        (es, e, ec), (cs, c, cc) = result[None], result[args.backend]
        ratios.append(c / e)
        if ec and cc:
            cpu_ratios.append(cc / ec)
        cpu = (f"{ec * 1e3:>7.1f}", f"{cc * 1e3:>7.1f}", f"{cc / ec:>6.3f}") if ec and cc else ("-",) * 3
        print(f"{r:>5} {es:>13.2f} {e * 1e3:>9.2f} {cpu[0]:>7} {cs:>16.2f} {c * 1e3:>11.2f} {cpu[1]:>7} "
              f"{c / e:>15.3f} {cpu[2]:>6}", flush=True)
    if ratios:
        print(f"median steady-state step, compiled/eager: {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})"
              + (f"; CPU per step {statistics.median(cpu_ratios):.3f} ({min(cpu_ratios):.3f}-{max(cpu_ratios):.3f})"
                 if cpu_ratios else "") + f"; load {os.getloadavg()[0]:.1f}")
    if args.split_cost:
        split_cost(spec, args)


if __name__ == "__main__":
    main()
