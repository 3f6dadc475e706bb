"""Does the simulator predict the CPU runtime? Profile a 1F1B run's phases, simulate, compare.

1. Run ``Trainer.with_schedule`` (1F1B, pp=2, Ray + gloo on 127.0.0.1) for a few steps and
   time each step (the mean after warm-up steps is "measured").
2. Profile in this process, with one torch thread as each worker uses: the forward and the
   backward of every captured segment module on one microbatch (inputs produced by the
   preceding segments), and the optimizer step of every stage segment. Medians over repeats.
   Point-to-point transfers are timed as a gloo send/recv of the largest boundary tensor
   between two local processes (latency per message; CPU tensors are small here).
3. ``simulate`` the compiled program with those costs; report simulated / measured.

    RAY_USAGE_STATS_ENABLED=0 GLOO_SOCKET_IFNAME=lo .venv/bin/python benchmarks/bench_simulate_vs_runtime.py \
        [--model lm] [--microbatches 8] [--steps 12]

Timings on a shared machine are noisy; the script prints its figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from piper_directives import capture
from piper_ir import Phase, SegmentRole
from piper_runtime import OptimizerSpec
from piper_scheduler import CostModel, simulate
from piper_train import Trainer
from piper_train.models import build_model


def measure_runtime(spec, pp: int, microbatches: int, steps: int, warmup: int) -> tuple[list[float], object]:  # noqa: ANN001
    with Trainer.with_schedule(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn,
                               schedule="1f1b", pp=pp, microbatches=microbatches,
                               optimizer=OptimizerSpec("sgd", 0.01)) as trainer:
        times = []
        for step in range(warmup + steps):
            inputs, targets = spec.batches(step)
            t0 = time.perf_counter()
            trainer.step(inputs, targets)
            times.append(time.perf_counter() - t0)
        return times[warmup:], trainer.program


def _median_time(fn, repeats: int) -> float:  # noqa: ANN001
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def profile_segments(spec, microbatches: int, repeats: int) -> dict[str, dict[str, float]]:  # noqa: ANN001
    """Seconds per (segment, phase) on one microbatch, one torch thread."""
    torch.set_num_threads(1)
    captured = capture(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn)
    graph = captured.graph
    mb = captured.batch_size // microbatches
    values: dict[str, torch.Tensor] = {}
    for name, t in zip(graph.inputs, spec.example_inputs, strict=True):
        values[name] = t[:mb]
    for name, t in zip(graph.targets, spec.example_targets, strict=True):
        values[name] = t[:mb]
    costs: dict[str, dict[str, float]] = {}
    for seg in graph.segments:
        module = captured.modules[seg.id]

        def args(seg=seg):  # noqa: ANN001, ANN202
            out = []
            for name in seg.inputs:
                t = values[name]
                if t.is_floating_point() and graph.value_by_name[name].meta.requires_grad:
                    t = t.detach().requires_grad_(True)
                out.append(t)
            return out

        def forward(seg=seg, module=module):  # noqa: ANN001, ANN202
            out = module(*args(seg))
            outs = (out / microbatches,) if seg.role is SegmentRole.LOSS else (
                (out,) if isinstance(out, torch.Tensor) else tuple(out))
            return outs

        f_time = _median_time(forward, repeats)
        b_samples = []
        for _ in range(repeats):
            outs = forward()
            grads = None if seg.role is SegmentRole.LOSS else [torch.ones_like(o) for o in outs]
            t0 = time.perf_counter()
            torch.autograd.backward(list(outs), grads)
            b_samples.append(time.perf_counter() - t0)
        costs[seg.id] = {"F": f_time, "B": statistics.median(b_samples)}
        if seg.role is SegmentRole.STAGE:
            for name, o in zip(seg.outputs, forward(), strict=True):
                values[name] = o.detach()
            params = [p for p in module.parameters() if p.requires_grad]
            if params:
                opt = OptimizerSpec("sgd", 0.0).build(params)

                def step(opt=opt, params=params):  # noqa: ANN001, ANN202
                    for p in params:
                        p.grad = torch.zeros_like(p)
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                costs[seg.id]["OPT"] = _median_time(step, repeats)
    return costs


def _p2p_worker(rank: int, port: int, numel: int, repeats: int, out) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.zeros(numel)
    samples = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        samples.append((time.perf_counter() - t0) / 2)
    if rank == 0:
        out.put(statistics.median(samples))
    dist.destroy_process_group()


def profile_p2p(numel: int, repeats: int = 50) -> float:
    """Seconds for one gloo message of ``numel`` floats between two local processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_p2p_worker, args=(r, port, numel, repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lm", choices=["mlp", "transformer", "lm"])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    spec = build_model(args.model, stages=args.pp, seed=0)
    times, program = measure_runtime(spec, args.pp, args.microbatches, args.steps, args.warmup)
    measured = statistics.mean(times)

    seg_costs = profile_segments(spec, args.microbatches, args.repeats)
    boundary = max((v.meta.numel() for v in program.values if v.name.startswith("v:")
                    and v.name not in program.inputs), default=1)
    latency = profile_p2p(boundary)
    overrides = {seg: {Phase(ph): c for ph, c in phases.items()} for seg, phases in seg_costs.items()}
    costs = CostModel(F=0, B=0, OPT=0, overrides=overrides, latency=latency)
    timeline = simulate(program, costs)
    free_comm = simulate(program, CostModel(F=0, B=0, OPT=0, overrides=overrides))
    ratio = timeline.makespan / measured

    print(f"model {args.model}, 1F1B, pp={args.pp}, microbatches={args.microbatches}, "
          f"{args.steps} timed steps after {args.warmup} warm-up")
    print("profiled per microbatch (ms): " + "; ".join(
        f"{seg} " + " ".join(f"{ph}={c * 1e3:.2f}" for ph, c in phases.items()) for seg, phases in seg_costs.items()))
    print(f"p2p message ({boundary} floats): {latency * 1e3:.3f} ms")
    print(f"measured step:  mean {measured * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms, "
          f"min {min(times) * 1e3:.1f} ms")
    print(f"simulated step: {timeline.makespan * 1e3:.1f} ms ({free_comm.makespan * 1e3:.1f} ms with free transfers)")
    print(f"simulated / measured = {ratio:.3f}  (within 20%: {'yes' if abs(ratio - 1) <= 0.2 else 'no'})")


if __name__ == "__main__":
    main()
