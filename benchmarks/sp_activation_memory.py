"""Per-rank activation memory and tensor-parallel traffic of one LLaMA block with and without
sequence parallelism (issue 37, item 8 for SP), against ``piper_memory``'s estimate.

One block of examples/llama (dim 64, 4 query heads, 2 kv heads, SwiGLU) is captured and cut for
tp=2 (``shard_modules``); its forward runs on one device and on two ranks (threads, a
shared-buffer communicator that counts the bytes each rank hands to a collective). The bytes a
forward keeps for its backward are the distinct storages of ``saved_tensors_hooks`` minus
the parameters; ``piper_memory.estimate`` given a one-device profile (``activation_bytes``, as
``piper tune`` did before it profiled one rank of each variant) counts one device's bytes, with or
without TP or SP (the "estimate / measured" column). benchmarks/bench_sharded_memory.py holds the
estimate ``piper tune`` now makes, with one rank's profile, against the runtime's measurement,
for TP, SP, the vocabulary-parallel head and CP (docs/memory.md). Traffic: the bytes a
rank sends per forward and backward in ring algorithms (all-reduce 2(n-1)/n B, reduce-scatter
(n-1)/n B, all-gather (n-1) b for B the whole tensor and b a rank's slice).

    .venv/bin/python benchmarks/sp_activation_memory.py [--seq 64] [--batch 8]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from piper_directives import Place, Shard, Strategy, capture, shard_modules
from piper_directives.shard_code import COMM, shard_tensor

ROOT = Path(__file__).resolve().parents[1]


def _llama():
    spec = importlib.util.spec_from_file_location("piper_example_llama_bench", ROOT / "examples" / "llama" / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _Group:
    def __init__(self, n: int) -> None:
        self.n, self.barrier, self.parts, self.sent = n, threading.Barrier(n), {}, [0] * n

    def _exchange(self, rank: int, t: torch.Tensor, factor: float) -> list[torch.Tensor]:
        self.sent[rank] += factor * t.numel() * t.element_size()
        self.parts[rank] = t.clone()
        self.barrier.wait()
        parts = [self.parts[r] for r in range(self.n)]
        self.barrier.wait()
        return parts

    def comm(self, rank: int):
        group = self

        class Comm:
            # bytes a rank sends in ring algorithms: 2(n-1)/n B, (n-1) b, (n-1)/n B
            def all_reduce(self, t):
                t.copy_(sum(group._exchange(rank, t, 2 * (group.n - 1) / group.n)))

            def all_gather(self, out, t):
                out.copy_(torch.cat(group._exchange(rank, t, group.n - 1)))

            def reduce_scatter(self, out, t):
                out.copy_(sum(group._exchange(rank, t, (group.n - 1) / group.n)).chunk(group.n)[rank])

        return Comm()


def _kept(module: torch.nn.Module, args, skip: set[int]) -> tuple[int, torch.Tensor]:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args)
    out = out[0] if isinstance(out, tuple) else out
    return sum(seen.values()), out


def run(seq: int, batch: int, tp: int, sp: bool, segment: str = "s1") -> dict[str, int]:
    llama = _llama()
    torch.manual_seed(0)
    model = llama.Transformer(llama.ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=seq))
    tokens = torch.randint(0, 256, (batch, seq))
    captured = capture(model, (tokens,), (tokens,), lambda lo, t: F.cross_entropy(lo.flatten(0, 1), t.flatten()))
    devices = tuple(range(tp))
    places = [Place({"PP": i}, devices) for i in range(3)]
    graph = Strategy([*places, Shard({}, devices, sequence_parallel=sp)]).apply(captured.graph)
    graph, modules = shard_modules(graph, captured.modules)
    sh = next(s for s in graph.sharding if s.segment == segment)
    seg = graph.segment_by_id[segment]
    x = torch.randn(graph.value_by_name[seg.inputs[0]].meta.shape, requires_grad=True)
    args = (x, *[torch.zeros(graph.value_by_name[n].meta.shape) for n in seg.inputs[1:]])
    one = captured.modules[segment]
    one_bytes, _ = _kept(one, args, {p.untyped_storage().data_ptr() for p in one.parameters()})
    group, kept, errors = _Group(tp), {}, []

    def rank(r: int) -> None:
        try:
            m = copy.deepcopy(modules[segment])
            with torch.no_grad():
                for spec in sh.params:
                    p = m.get_parameter(spec.name)
                    p.data = shard_tensor(p.data, spec, sh.degree, r)
            m.get_submodule(COMM).bind_communicator(group.comm(r), position=r)
            kept[r], out = _kept(m, args, {p.untyped_storage().data_ptr() for p in m.parameters()})
            out.sum().backward()
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {"one": one_bytes, "rank": kept[0], "sent": int(group.sent[0])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    print("| tp | sp | one device (KiB) | per rank (KiB) | rank / one device | estimate / measured | "
          "sent per rank, fwd+bwd (KiB) |")
    print("|---|---|---|---|---|---|---|")
    for tp in (2, 4):
        for sp in (False, True):
            r = run(args.seq, args.batch, tp, sp)
            print(f"| {tp} | {'yes' if sp else 'no'} | {r['one'] / 1024:.0f} | {r['rank'] / 1024:.0f} | "
                  f"{r['rank'] / r['one']:.3f} | {r['one'] / r['rank']:.2f} | "
                  f"{r['sent'] / 1024:.0f} |")


if __name__ == "__main__":
    main()
