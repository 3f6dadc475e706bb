"""Do two of the CUDA backend's streams really overlap? A compute kernel on one lane and a
host-to-device copy on another, each alone and then both at once.

Uses the backend's own lanes (``DeviceStreams`` on ``CupyDevice``: cupy streams that torch
runs on through ``ExternalStream``), two host threads as the runtime does. Prints the median
over repeats of each case and the verdict: the streams overlap when both together take
clearly less than the sum of each alone (``--margin``, default 0.9 of the sum). Exit code 0
when they overlap, 1 when not, 2 without a GPU. Needs a GPU; benchmarks/gpu_check.sh runs it.

    python benchmarks/gpu_overlap.py [--matmuls 20] [--size 4096] [--copy-mib 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matmuls", type=int, default=20)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--margin", type=float, default=0.9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from piper_runtime.backends import cuda_missing

    missing = cuda_missing()
    if missing:
        print(f"gpu_overlap: cannot run: {missing}", file=sys.stderr)
        return 2
    import torch

    from piper_runtime.backends.device import CupyDevice
    from piper_runtime.backends.device_streams import DeviceStreams

    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = CupyDevice(0)
    lanes = DeviceStreams(gpu)
    a = torch.randn(args.size, args.size, device=gpu.device)
    b = torch.randn(args.size, args.size, device=gpu.device)
    src = torch.empty(args.copy_mib << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=gpu.device)

    def compute() -> None:
        with lanes.lane("compute"):
            c = a
            for _ in range(args.matmuls):
                c = torch.mm(c, b) / args.size

    def copy() -> None:
        with lanes.lane("copy"):
            dst.copy_(src, non_blocking=True)

    def timed(*work) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        threads = [threading.Thread(target=w) for w in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    timed(compute, copy)  # warm up (kernels, allocator, pinned pages)
    runs = {"compute": [], "copy": [], "both": []}
    for _ in range(args.repeats):
        runs["compute"].append(timed(compute))
        runs["copy"].append(timed(copy))
        runs["both"].append(timed(compute, copy))
    ms = {k: statistics.median(v) * 1000 for k, v in runs.items()}
    total = ms["compute"] + ms["copy"]
    overlap = ms["both"] < args.margin * total
    hidden = (total - ms["both"]) / min(ms["compute"], ms["copy"])
    if args.json:
        print(json.dumps({**{f"{k}_ms": v for k, v in ms.items()}, "sum_ms": total, "overlap": overlap, "hidden": hidden}))
    else:
        name = torch.cuda.get_device_name(gpu.device)
        print(f"streams on {name}: {args.matmuls} x {args.size}^2 matmuls on one lane, {args.copy_mib} MiB "
              f"host-to-device on another (median of {args.repeats})")
        print(f"  compute alone   {ms['compute']:8.2f} ms")
        print(f"  copy alone      {ms['copy']:8.2f} ms")
        print(f"  sum             {total:8.2f} ms")
        print(f"  both at once    {ms['both']:8.2f} ms   ({hidden:.0%} of the shorter one hidden)")
        print(f"  {'OVERLAP' if overlap else 'NO OVERLAP'}: both at once {'<' if overlap else '>='} "
              f"{args.margin:g} x sum")
    return 0 if overlap else 1


if __name__ == "__main__":
    sys.exit(main())
