"""The torch half of the pipeline benchmark: ``torch.distributed.pipelining`` on CPU/gloo.

Runs a ``piper_train.models`` model, cut into ``pp`` stages along its annotated regions with
``stage_modules(pp)``, through ``ScheduleGPipe`` or ``Schedule1F1B``: one process per stage
on 127.0.0.1, one thread each, an SGD step every iteration. Each step is timed on rank 0
between two barriers, so a time covers the slowest rank. Piper's half runs the same model
and schedule as a directive program, so the two tables compare like for like. With
``compile`` (a ``torch.compile`` backend), each rank's stage modules run compiled
(``torch.compile(module, backend=...)`` handed to ``PipelineStage``), as Piper's
``--compile`` runs its segments, and the process keeps freed memory for the next allocation
as Piper's compiled ranks do (``piper_runtime.rank.freed_memory``: compiled code frees and
allocates its buffers at every call; without it torch's compiled 1F1B ``stack`` step took
106.7-108.0 ms against 101.7-102.1 ms with it, and 102-103 ms eager).

    .venv/bin/python benchmarks/torch_pipelining.py
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from piper_runtime.rank.freed_memory import keep_freed_memory
from piper_train.models import build_model

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}  # stages per rank (as Piper's library)
OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def run_torch_pipeline(
    schedule: str,
    model_name: str,
    pp: int,
    microbatches: int,
    steps: int,
    *,
    warmup: int = 2,
    lr: float = 0.01,
    seed: int = 0,
    optimizer: str = "sgd",
    optimizer_kwargs: dict[str, bool] | None = None,
    cpu: list[float] | None = None,
    compile: str | None = None,
) -> list[float]:
    """Time ``steps`` training steps (after ``warmup`` more) and return them in seconds.

    The model has ``pp`` annotated regions and stage i runs region i (interleaved 1F1B:
    ``2 pp`` regions, rank r running regions r and r + pp, as Piper's schedule); the batch of
    ``build_model(model_name)`` is split into ``microbatches`` equal microbatches (the
    batch size must divide evenly). ``optimizer_kwargs`` go to the torch optimizer (e.g.
    ``fused=True``; none: torch's default implementation). ``compile``: a ``torch.compile``
    backend for each stage module (``None``: eager).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {sorted(SCHEDULES)}")
    if pp < 1 or microbatches < 1 or steps < 1 or warmup < 0:
        raise ValueError("pp, microbatches and steps must be positive and warmup non-negative")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {sorted(OPTIMIZERS)}")
    batch = build_model(model_name, stages=pp * CHUNKS[schedule], seed=seed).example_inputs[0].size(0)
    if batch % microbatches:
        raise ValueError(f"{model_name} batch {batch} does not split into {microbatches} microbatches")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(
        _worker,
        args=(pp, _free_port(), schedule, model_name, microbatches, steps, warmup, lr, seed, optimizer,
              dict(optimizer_kwargs or {}), compile, results),
        nprocs=pp,
        join=True,
        start_method="spawn",
    )
    times: list[float] = []
    spent = 0.0
    for _ in range(pp):
        rank, rank_times, rank_cpu = results.get()
        spent += rank_cpu
        if rank == 0:
            times = rank_times
    if cpu is not None:
        cpu.append(spent / steps)
    return times


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    pp: int,
    port: int,
    schedule: str,
    model_name: str,
    microbatches: int,
    steps: int,
    warmup: int,
    lr: float,
    seed: int,
    optimizer: str,
    optimizer_kwargs: dict[str, bool],
    compile: str | None,
    results: mp.SimpleQueue,
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    if compile is not None:
        keep_freed_memory()  # glibc keeps freed memory, as in Piper's compiled ranks (module doc)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=pp)
    try:
        # Every rank builds the whole model from the same seed (identical weights), keeps
        # its own stage, and derives its stage's input shape by running the stages before it.
        chunks = CHUNKS[schedule]
        spec = build_model(model_name, stages=pp * chunks, seed=seed)
        parts = spec.model.stage_modules(pp * chunks)
        mine = [rank + k * pp for k in range(chunks)]
        stages, modules = [], []
        for index in mine:
            example = spec.example_inputs[0].chunk(microbatches)[0]
            with torch.no_grad():
                for part in parts[:index]:
                    example = part(example)
            modules.append(parts[index])
            run = parts[index] if compile is None else torch.compile(parts[index], backend=compile)
            stages.append(PipelineStage(run, index, pp * chunks, torch.device("cpu"), input_args=(example,)))
        if chunks == 1:
            sched = SCHEDULES[schedule](stages[0], n_microbatches=microbatches, loss_fn=spec.loss_fn)
        else:
            sched = SCHEDULES[schedule](stages, n_microbatches=microbatches, loss_fn=spec.loss_fn)
        opt = OPTIMIZERS[optimizer]([p for m in modules for p in m.parameters()], lr=lr, **optimizer_kwargs)
        first, last = rank == 0, rank == pp - 1
        times: list[float] = []
        cpu_start = 0.0
        for step in range(warmup + steps):
            if step == warmup:
                cpu_start = time.process_time()
            (x,), (y,) = spec.batches(step)
            opt.zero_grad()
            dist.barrier()
            start = time.perf_counter()
            args = (x,) if first else ()
            kwargs = {"target": y, "losses": []} if last else {}
            sched.step(*args, **kwargs)
            opt.step()
            dist.barrier()
            if step >= warmup:
                times.append(time.perf_counter() - start)
        results.put((rank, times, time.process_time() - cpu_start))
    finally:
        dist.destroy_process_group()


def main() -> None:
    pp, microbatches, steps = 2, 4, 10
    print(f"torch.distributed.pipelining on gloo/CPU, pp={pp}, {microbatches} microbatches, {steps} steps")
    print(f"{'model':<12} {'schedule':<8} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for model_name in ("mlp", "transformer", "lm"):
        for schedule in ("gpipe", "1f1b"):
            times = run_torch_pipeline(schedule, model_name, pp, microbatches, steps)
            ms = [t * 1e3 for t in times]
            print(
                f"{model_name:<12} {schedule:<8} {statistics.median(ms):>10.2f} {min(ms):>8.2f} {max(ms):>8.2f}"
            )


if __name__ == "__main__":
    main()
