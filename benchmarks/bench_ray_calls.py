"""What a step's Ray call costs: plain actor calls vs a Ray Compiled Graph, no training.

Each "step" hands every rank its part of a batch and gathers one small result per rank, as
``Runtime.submit`` does: once as one actor call per rank (``.remote`` + ``ray.get``), once
through a compiled graph (``experimental_compile``: shared-memory channels, the actors'
loop on a background thread). Medians of ``--steps`` round trips, side by side, alternating
for ``--repeats`` rounds. Ray's documentation quotes about 1 ms per plain call and under
50 us per compiled-graph execution; this measures what they cost on this machine.

    .venv/bin/python benchmarks/bench_ray_calls.py [--ranks 2] [--steps 300] [--repeats 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray
import torch
from ray.dag import InputNode, MultiOutputNode


@ray.remote(num_cpus=1)
class _Rank:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def step(self, batch: list[torch.Tensor]) -> tuple[int, float]:
        return self.rank, float(batch[self.rank].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ray.init(num_cpus=max(args.ranks, 2), include_dashboard=False, logging_level=logging.ERROR,
             log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        ranks = [_Rank.remote(r) for r in range(args.ranks)]
        batch = [torch.randn(32, 64) for _ in range(args.ranks)]
        with InputNode() as inp:
            graph = MultiOutputNode([r.step.bind(inp) for r in ranks])
        ray.get([r.step.remote(batch) for r in ranks], timeout=60)  # the actors are up
        t0 = time.perf_counter()
        compiled = graph.experimental_compile()
        compile_s = time.perf_counter() - t0

        def plain() -> None:
            ray.get([r.step.remote(batch) for r in ranks], timeout=60)

        def through_graph() -> None:
            ray.get(compiled.execute(batch), timeout=60)

        times: dict[str, list[float]] = {"plain": [], "compiled": []}
        for round_ in range(args.repeats):
            order = (("plain", plain), ("compiled", through_graph))
            for name, call in order if round_ % 2 == 0 else order[::-1]:
                for _ in range(10):
                    call()
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - t0)
        compiled.teardown()
        p, c = statistics.median(times["plain"]), statistics.median(times["compiled"])
        print(f"One step's calls to {args.ranks} ranks and their results, median of {args.steps * args.repeats}"
              f" (compile {compile_s:.2f} s, load {os.getloadavg()[0]:.1f})")
        print(f"{'plain us':>9} {'compiled us':>12} {'compiled/plain':>15}")
        print(f"{p * 1e6:>9.0f} {c * 1e6:>12.0f} {c / p:>15.2f}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
