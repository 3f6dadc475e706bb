"""Shared-memory channels vs gloo for point-to-point messages between ranks on one host.

1. Round trip: two processes bounce one tensor back and forth through the CPU backend's
   two transports, gloo's point-to-point and a ``piper_runtime.backends.shm`` channel
   pair; median microseconds per round trip, per message size, and shm/gloo.
2. Piper's step: the same ``Trainer`` run (as ``bench_pipeline.py`` times it: results with
   one step in flight) with its point-to-point messages through shared memory (the default)
   and through gloo (``PIPER_SHM_DISABLE=1``), alternating for ``--repeats`` rounds; medians
   and shm/gloo.

    .venv/bin/python benchmarks/bench_shm.py [--sizes 4096,131072,4194304] [--models stack,mlp]
        [--schedules 1f1b] [--pp 2] [--steps 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.multiprocessing as mp

from piper_runtime.backends.cpu import SHM_DISABLE_ENV, CpuBackend
from piper_train.tuning.profiler import round_trip

ROUNDS = 300


def _bounce(rank: int, size: int, port: int, out: mp.Queue) -> None:
    """One end: the CPU backend's point-to-point on a group told of its channels (shared
    memory) and on one that is not (gloo), alternately."""
    torch.set_num_threads(1)
    backend = CpuBackend()
    backend.connect(rank, 2, "127.0.0.1", port, 60.0)  # its store listens on loopback only
    links = {"gloo": backend.communicator([0, 1]), "shm": backend.communicator([0, 1], [(0, 1), (1, 0)])}
    assert links["shm"].senders, "no shared-memory channels here"
    message, into = torch.zeros(size // 4), torch.empty(size // 4)

    times: dict[str, list[float]] = {"gloo": [], "shm": []}
    for r in range(4):  # alternate, so drifting load falls on both
        for name in ("gloo", "shm") if r % 2 == 0 else ("shm", "gloo"):
            for _ in range(20):
                round_trip(links[name], rank, message, into)
            links["gloo"].all_reduce(torch.zeros(1))  # start together
            for _ in range(ROUNDS // 4):
                t0 = time.perf_counter()
                round_trip(links[name], rank, message, into)
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        out.put({name: statistics.median(t) for name, t in times.items()})
    links["gloo"].all_reduce(torch.zeros(1))
    backend.shutdown()


def round_trips(sizes: list[int]) -> None:
    print(f"Round trip of one message between two processes, median of {ROUNDS} (load {os.getloadavg()[0]:.1f})")
    header = f"{'bytes':>10} {'gloo us':>9} {'shm us':>9} {'shm/gloo':>9}"
    print(header + "\n" + "-" * len(header), flush=True)
    ctx = mp.get_context("spawn")
    for i, size in enumerate(sizes):
        out = ctx.Queue()
        port = 29600 + os.getpid() % 1000 + i
        procs = [ctx.Process(target=_bounce, args=(r, size, port, out), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        try:
            result = out.get(timeout=120)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        print(f"{size:>10} {result['gloo'] * 1e6:>9.0f} {result['shm'] * 1e6:>9.0f}"
              f" {result['shm'] / result['gloo']:>9.2f}", flush=True)


def piper_steps(models: list[str], schedules: list[str], pps: list[int], microbatches: int, steps: int,
                repeats: int) -> None:
    from bench_pipeline import run_piper

    from piper_runtime import ensure_ray

    ensure_ray(num_cpus=max(os.cpu_count() or 1, 2 * max(pps)))
    print(f"\nPiper's step, messages through shared memory vs gloo: {microbatches} microbatches, {steps} timed "
          f"steps per round, {repeats} alternating rounds, medians")
    header = (f"{'model':<12} {'schedule':<17} {'pp':>2} {'gloo ms':>8} {'shm ms':>8} {'shm/gloo':>9}"
              f" {'in-worker shm/gloo':>19} {'load':>5}")
    print(header + "\n" + "-" * len(header), flush=True)
    for model in models:
        for pp in pps:
            for schedule in schedules:
                wall: dict[str, list[float]] = {"shm": [], "gloo": []}
                inside: dict[str, list[float]] = {"shm": [], "gloo": []}
                loads = [os.getloadavg()[0]]
                for r in range(repeats):
                    for name in ("gloo", "shm") if r % 2 == 0 else ("shm", "gloo"):
                        if name == "gloo":
                            os.environ[SHM_DISABLE_ENV] = "1"
                        else:
                            os.environ.pop(SHM_DISABLE_ENV, None)
                        t, i, _ = run_piper(schedule, model, pp, microbatches, steps)
                        wall[name].extend(t)
                        inside[name].extend(i)
                        loads.append(os.getloadavg()[0])
                os.environ.pop(SHM_DISABLE_ENV, None)
                g, s = statistics.median(wall["gloo"]), statistics.median(wall["shm"])
                gi, si = statistics.median(inside["gloo"]), statistics.median(inside["shm"])
                print(f"{model:<12} {schedule:<17} {pp:>2} {g * 1e3:>8.1f} {s * 1e3:>8.1f} {s / g:>9.2f}"
                      f" {si / gi:>19.2f} {statistics.fmean(loads):>5.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,131072,4194304")
    parser.add_argument("--models", default="stack,mlp")
    parser.add_argument("--schedules", default="1f1b")
    parser.add_argument("--pp", type=int, nargs="+", default=[2])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.sizes:
        round_trips([int(s) for s in args.sizes.split(",")])
    if args.models:
        piper_steps(args.models.split(","), args.schedules.split(","), args.pp, args.microbatches, args.steps,
                    args.repeats)


if __name__ == "__main__":
    main()
