"""Whether a compiled CPU kernel lets other threads of the process run (``piper_runtime.rank.kernel_gil``).

The ``local`` runtime's ranks are threads of one process. While one thread runs a function,
another thread counts in a Python loop; the count per second during the call, against the
same loop's rate while the first thread only sleeps, says how much of the call the GIL was free. Three
ways to run the same pointwise function (``gelu(x) * 2 + tanh(x)`` on ``--numel`` floats, one
fused kernel when compiled): eager aten operators (they release the GIL), inductor through
``torch.compile`` (its kernel bindings hold it), and inductor through Piper's
``compile_graph`` (``releasing_gil``). Alternated over ``--rounds``; medians printed.

    .venv/bin/python benchmarks/bench_kernel_gil.py [--numel 20000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from piper_runtime.rank.compiled import compile_graph


def pointwise(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x) * 2 + torch.tanh(x)


def counted(call, x: torch.Tensor) -> tuple[float, float]:
    """(the call's seconds, the other thread's Python loop iterations per second meanwhile)."""
    state = {"stop": False, "count": 0}

    def spin() -> None:
        while not state["stop"]:
            state["count"] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.05)
    before, started = state["count"], time.perf_counter()
    call(x)
    seconds = time.perf_counter() - started
    counted_ = state["count"] - before
    state["stop"] = True
    thread.join()
    return seconds, counted_ / seconds


def alone_rate(seconds: float = 0.3) -> float:
    """The other thread's rate while this one only sleeps (the same loop, the same thread setup)."""
    _, rate = counted(lambda _: time.sleep(seconds), torch.empty(0))
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=20_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.setswitchinterval(0.0005)
    x = torch.randn(args.numel)
    releasing = compile_graph(make_fx(lambda t: (pointwise(t),))(x), "inductor")
    ways = {"eager (aten)": pointwise, "torch.compile (inductor's binding)": torch.compile(pointwise),
            "compile_graph (releasing_gil)": lambda t: releasing(t)}
    for call in ways.values():
        call(x)
    rates: dict[str, list[float]] = {name: [] for name in ways}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    alone: list[float] = []
    for _ in range(args.rounds):
        alone.append(alone_rate())
        for name, call in ways.items():
            s, r = counted(call, x)
            seconds[name].append(s)
            rates[name].append(r)
    base = statistics.median(alone)
    print(f"{args.numel:,} floats, torch {torch.__version__}, 1 thread, load {os.getloadavg()[0]:.1f}; "
          f"the other thread alone: {base:,.0f} iterations/s")
    print(f"{'way':<36} {'call ms':>9} {'other thread /s':>16} {'share of alone':>15}")
    for name in ways:
        r = statistics.median(rates[name])
        print(f"{name:<36} {statistics.median(seconds[name]) * 1e3:9.1f} {r:16,.0f} {r / base:15.2f}")


if __name__ == "__main__":
    main()
