"""Every rank of a pipelined step on one clock: where a schedule's step waits for messages.

One Trainer (``--schedule``, ``--pp`` ranks, ``--microbatches``, AdamW) runs ``--steps``
steps the way ``fit`` does (``Trainer.submit``, one step in flight ahead) with
``profile=True``. Each rank reports when its step began (``StepResult.worker_started``,
``time.perf_counter``: CLOCK_MONOTONIC, one clock for the processes of a host), so every
instruction of every rank lands on one time line. Each ``SEND`` is matched with its
``RECV`` (the k-th message of a channel, in plan order on both ends), which gives per
message:

- *delivery*: from the start of the send to the end of the receive, for messages whose
  receiver was already waiting: the copy in, the wake-up and the copy out a message costs
  on the critical path (median, and the sum over the step's messages);
- *sender's stall*: the send's own duration (a copy and a pipe write, or gloo's post): a
  sender whose write wakes its receiver can lose its core to it;
- *early*: messages whose receive began after the send started (nothing to wait for).

Per rank: compute, time waiting in receives, the gaps between instructions, and the time
from the step's start to its first instruction. ``--show`` prints the median step's time
line (µs from the earliest rank's start).

    .venv/bin/python benchmarks/bench_timeline.py [--model mlp] [--schedule 1f1b] [--pp 2]
        [--microbatches 8] [--steps 12] [--show] [--input-grads-first on|off]
"""

from __future__ import annotations

import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from stepping import pipelined, trainer_arguments

from piper_ir import Instruction, NodeKind, Program
from piper_runtime import OptimizerSpec, StepResult
from piper_train.models import build_model
from piper_train.trainer import Trainer


def messages(program: Program) -> list[tuple[tuple[int, str], tuple[int, str]]]:
    """Each message as ((sender, SEND id), (receiver, RECV id)): the k-th send of a channel
    (sender, receiver, communicator) with the k-th receive of it."""
    sends: dict[tuple[int, int, str | None], list[str]] = defaultdict(list)
    recvs: dict[tuple[int, int, str | None], list[str]] = defaultdict(list)
    for plan in program.ranks:
        for ins in plan.instructions:
            if ins.kind is NodeKind.SEND:
                sends[(plan.rank, ins.peer, ins.communicator)].append(ins.id)
            elif ins.kind is NodeKind.RECV:
                recvs[(ins.peer, plan.rank, ins.communicator)].append(ins.id)
    out = []
    for (a, b, comm), ids in sends.items():
        for s, r in zip(ids, recvs[(a, b, comm)], strict=True):
            out.append(((a, s), (b, r)))
    return out


def on_one_clock(result: StepResult) -> dict[tuple[int, str], tuple[float, float]]:
    """(rank, instruction id) -> (start, end), seconds from the earliest rank's step start."""
    origin = min(result.worker_started)
    return {
        (t.rank, t.instruction): (result.worker_started[t.rank] + t.start - origin,
                                  result.worker_started[t.rank] + t.end - origin)
        for t in result.timings
    }


def analyse(program: Program, result: StepResult) -> dict[str, float]:
    """Seconds per figure of one step (module doc)."""
    when = on_one_clock(result)
    kinds = {(plan.rank, ins.id): ins.kind for plan in program.ranks for ins in plan.instructions}
    out: dict[str, float] = defaultdict(float)
    delivery = []
    early = 0
    for (a, s), (b, r) in messages(program):
        send, got = when[(a, s)], when[(b, r)]
        out["send.max"] = max(out["send.max"], send[1] - send[0])
        if got[0] < send[0]:
            delivery.append(got[1] - send[0])
        else:
            early += 1
    out["delivery"] = statistics.median(delivery) if delivery else 0.0
    out["delivery.sum"] = sum(delivery)
    out["waited"] = len(delivery)
    out["early"] = early
    for rank in range(len(result.worker_started)):
        mine = sorted((v, k) for k, v in when.items() if k[0] == rank)
        reach = mine[0][0][0]
        out[f"r{rank}.first"] = reach - (result.worker_started[rank] - min(result.worker_started))
        for (start, end), key in mine:
            out[f"r{rank}.gaps"] += max(0.0, start - reach)
            reach = max(reach, end)
            part = {NodeKind.RECV: "recv", NodeKind.SEND: "send"}.get(kinds[key], "compute")
            out[f"r{rank}.{part}"] += end - start
        out[f"r{rank}.step"] = result.worker_seconds[rank]
    return out


def between_steps(results: list[StepResult]) -> list[tuple[list[float], list[float], list[float]]]:
    """Per rank, for each pair of consecutive steps: seconds from the last instruction's end
    to the step's return (its sends, building its output), from that return to the next
    step's start in the worker (returning the result, Ray taking the next call), and from
    there to the next step's first instruction (taking the batch apart)."""
    out = []
    for rank in range(len(results[0].worker_started)):
        tail, boundary, head = [], [], []
        for a, b in zip(results, results[1:], strict=False):
            last = max(t.end for t in a.timings if t.rank == rank)
            tail.append(a.worker_seconds[rank] - last)
            boundary.append(b.worker_started[rank] - a.worker_started[rank] - a.worker_seconds[rank])
            head.append(min(t.start for t in b.timings if t.rank == rank))
        out.append((tail, boundary, head))
    return out


def show(program: Program, result: StepResult) -> None:
    """The step's instructions of every rank, in time order (µs)."""
    when = on_one_clock(result)
    names: dict[tuple[int, str], Instruction] = {
        (plan.rank, ins.id): ins for plan in program.ranks for ins in plan.instructions
    }
    for key, (start, end) in sorted(when.items(), key=lambda kv: kv[1][0]):
        ins = names[key]
        pad = "    " * 6 * key[0]
        print(f"{start * 1e6:9.0f} {end * 1e6:9.0f} {pad}r{key[0]} {ins.short()} ({(end - start) * 1e6:.0f})")


def main() -> None:
    parser = trainer_arguments(__doc__.splitlines()[0], steps=12)
    parser.add_argument("--show", action="store_true", help="print the median step's time line")
    parser.add_argument("--input-grads-first", choices=("on", "off"), default="on",
                        help="a stage's last backward sends its input gradient before its weight products "
                             "(piper_runtime.rank.input_grads_first)")
    args = parser.parse_args()
    spec = build_model(args.model, stages=args.pp * (2 if args.schedule == "interleaved_1f1b" else 1))
    load = os.getloadavg()[0]
    with Trainer.with_schedule(
        spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, schedule=args.schedule, pp=args.pp,
        microbatches=args.microbatches, optimizer=OptimizerSpec("adamw", 1e-3), reuse_workers=True,
        input_grads_first=args.input_grads_first == "on",
    ) as trainer:
        program = trainer.program
        for k in range(3):
            trainer.step(*spec.batches(k))  # warm-up
        results = pipelined(trainer, [spec.batches(3 + k) for k in range(args.steps)], profile=True)
    rows = [analyse(program, r) for _, r in results]
    boundary = between_steps([r for _, r in results])
    print(f"{args.model}, {args.schedule}, pp={args.pp}, {args.microbatches} microbatches: medians of "
          f"{args.steps} steps (load {load:.1f}-{os.getloadavg()[0]:.1f})")
    print(f"  step between results on the driver: {statistics.median(t for t, _ in results) * 1e3:.2f} ms")
    print(f"  messages whose receiver waited: {statistics.median(r['waited'] for r in rows):.0f}, "
          f"already there: {statistics.median(r['early'] for r in rows):.0f}; "
          f"delivery when waited for: {statistics.median(r['delivery'] for r in rows) * 1e6:.0f} us "
          f"(per step: {statistics.median(r['delivery.sum'] for r in rows) * 1e3:.2f} ms); "
          f"longest send: {statistics.median(r['send.max'] for r in rows) * 1e6:.0f} us")
    print("| rank | step (ms) | to first instruction | compute | receives | sends | gaps |\n|---|---|---|---|---|---|---|")
    for rank in range(args.pp):
        cell = [statistics.median(r[f"r{rank}.{part}"] for r in rows) * 1e3
                for part in ("step", "first", "compute", "recv", "send", "gaps")]
        print(f"| {rank} | " + " | ".join(f"{c:.2f}" for c in cell) + " |")
    print("Between steps on each rank (ms, median): the last instruction's end to the step's return, "
          "the return to the next step's start, that start to its first instruction")
    for rank, parts in enumerate(boundary):
        print(f"  rank {rank}: " + ", ".join(f"{statistics.median(p) * 1e3:.2f}" for p in parts))
    if args.show:
        order = sorted(range(len(results)), key=lambda k: results[k][0])
        show(program, results[order[len(order) // 2]][1])


if __name__ == "__main__":
    main()
