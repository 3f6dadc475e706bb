"""One pipeline stage's step with glibc's malloc as it comes and with freed memory kept.

By default glibc hands large freed blocks back to the kernel, so every step's tensors fault
in fresh pages: about 2,000 minor faults per step of one ``stack`` stage, at about 3 us each
here. Raising glibc's mmap and trim thresholds (``mallopt``, as jemalloc or tcmalloc would
behave) keeps freed blocks in the process and removes the faults. This benchmark measures
whether that makes a step faster, which decides whether Piper's workers should do it
(docs/benchmarks.md: they do not). The stage is one stage of a model (default ``stack``,
pp=2): forwards and backwards of ``--microbatches`` microbatches in 1F1B order (two in
flight), then the optimizer (fused AdamW, as Piper runs it). It runs on a thread of its own,
as in a worker, with one torch thread. Linux with glibc only.

Each round starts one fresh process per setting, so malloc's state is its own: first
"default", then "kept", then the reverse order in the next round. Each process times its
steps after a warm-up. Printed per round: the median step time, the median CPU time of the
stage's thread per step (page faults are system time of the thread that takes them; CPU
time follows this machine's load less than wall time does) and the minor page faults per
step; then each round's kept/default ratios, and their medians.

    .venv/bin/python benchmarks/bench_host_memory.py [--model stack] [--rounds 8] [--steps 20]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import resource
import statistics
import threading
import time

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise this process's malloc thresholds to 1 GiB; whether glibc took them."""
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD))


def _stage_steps(model: str, microbatches: int, steps: int, keep: bool, out: mp.SimpleQueue) -> None:
    def run() -> None:
        import torch

        from piper_train.models import build_model

        kept = keep_freed_memory() if keep else False
        torch.set_num_threads(1)
        spec = build_model(model, stages=2)
        stage = spec.model.stage_modules(2)[0]
        opt = torch.optim.AdamW(stage.parameters(), lr=1e-3, fused=True)
        inputs = spec.example_inputs[0].chunk(microbatches)
        times, cpu, faults = [], [], 0
        warmup = 3
        for step in range(warmup + steps):
            if step == warmup:
                faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            start, start_cpu = time.perf_counter(), time.thread_time()
            in_flight = [stage(x) for x in inputs[:2]]
            for x in inputs[2:]:
                in_flight.pop(0).float().square().mean().backward()
                in_flight.append(stage(x))
            for y in in_flight:
                y.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
        faults = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults) / steps
        out.put((kept, statistics.median(times[warmup:]), statistics.median(cpu[warmup:]), faults))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stack")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print(f"one stage of {args.model} (pp=2), {args.microbatches} microbatches in 1F1B order, fused AdamW, "
          f"one torch thread; {args.steps} timed steps per process, {args.rounds} rounds")
    print(f"{'round':>5} {'default ms':>11} {'CPU ms':>7} {'faults':>7} {'kept ms':>8} {'CPU ms':>7} {'faults':>7}"
          f" {'kept/default':>13} {'CPU':>6}")
    ratios, cpu_ratios = [], []
    for r in range(args.rounds):
        result = {}
        for keep in (False, True) if r % 2 == 0 else (True, False):
            queue = ctx.SimpleQueue()
            proc = ctx.Process(target=_stage_steps, args=(args.model, args.microbatches, args.steps, keep, queue))
            proc.start()
            proc.join(timeout=600)
            if proc.exitcode != 0:
                raise SystemExit(f"the {'kept' if keep else 'default'} process failed (exit code {proc.exitcode})")
            kept, seconds, cpu, faults = queue.get()
            if keep and not kept:
                raise SystemExit("mallopt refused the thresholds (not glibc?)")
            result[keep] = (seconds, cpu, faults)
        (d, dc, df), (k, kc, kf) = result[False], result[True]
        ratios.append(k / d)
        cpu_ratios.append(kc / dc)
        print(f"{r:>5} {d * 1e3:>11.1f} {dc * 1e3:>7.1f} {df:>7.0f} {k * 1e3:>8.1f} {kc * 1e3:>7.1f} {kf:>7.0f}"
              f" {k / d:>13.3f} {kc / dc:>6.3f}", flush=True)
    print(f"median kept/default: wall {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}),"
          f" CPU {statistics.median(cpu_ratios):.3f} (rounds {min(cpu_ratios):.3f}-{max(cpu_ratios):.3f})")


if __name__ == "__main__":
    main()
