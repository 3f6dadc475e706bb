"""Does loading data overlap the step? Step time with a data loader vs one fixed batch.

The byte-level LM (1F1B, PP=2, 4 microbatches) trains on windows of the standard library's
source drawn from a ``Dataset`` whose every sample costs ``--sample-ms`` of loading (a sleep,
as reading or decoding would; it releases the GIL like I/O does), batched by a
``DataLoader`` in the driver process. Three runs of the same trainer:

- ``fixed``: one batch reused every step (no loading at all), the baseline;
- ``loader, prefetch``: ``piper_train.batches.Prefetcher`` draws the next batch on a thread
  while the workers run the current step (what ``piper train`` does);
- ``loader, inline``: each batch loaded when its step starts.

The three alternate over ``--rounds`` rounds (the machine's load drifts); it prints the
median time per step (waiting for the batch plus the step, ``--warmup`` steps left out of
each round) and the ratios to ``fixed``. A ratio near 1 for ``prefetch`` means loading is hidden.
No timing is asserted anywhere: this is a measurement (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import Dataset

from piper_directives import build_schedule
from piper_runtime import OptimizerSpec, ensure_ray, shutdown
from piper_train.batches import BatchStream, Prefetcher
from piper_train.data import stdlib_corpus
from piper_train.loop import fit
from piper_train.models import TinyTransformer, lm_loss
from piper_train.trainer import Trainer

SEQ, BATCH = 64, 16


class Windows(Dataset):
    """``(tokens, next tokens)`` windows of a byte corpus; each sample costs ``cost_s``."""

    def __init__(self, corpus: bytes, cost_s: float) -> None:
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).to(torch.int64)
        self.cost_s = cost_s

    def __len__(self) -> int:
        return (len(self.data) - 1) // SEQ

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.cost_s)
        window = self.data[i * SEQ : i * SEQ + SEQ + 1]
        return window[:-1], window[1:]


def _per_step(trainer: Trainer, data, steps: int, warmup: int) -> list[float]:
    start = trainer.state.step
    run = fit(trainer, data, steps=start + warmup + steps)
    return [m.step_seconds + m.data_seconds for m in run.steps[warmup:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample-ms", type=float, default=1.0, help="loading cost of one sample (default: 1 ms)")
    args = parser.parse_args()
    ensure_ray(num_cpus=4)
    try:
        dataset = Windows(stdlib_corpus(), args.sample_ms / 1000)
        stream = BatchStream(dataset, batch_size=BATCH, seed=0)
        inputs, targets = next(BatchStream(dataset, batch_size=BATCH, seed=0))
        torch.manual_seed(0)
        model = TinyTransformer(256, 64, 4, 2, SEQ)
        with Trainer(model, inputs, targets, lm_loss, build_schedule("1f1b", 2, 4, stages=2),
                     optimizer=OptimizerSpec("adamw", 3e-3)) as trainer:
            times: dict[str, list[float]] = {"fixed batch": [], "loader, prefetch": [], "loader, inline": []}
            for _ in range(args.rounds):
                times["fixed batch"] += _per_step(trainer, iter(lambda: (inputs, targets), None), args.steps, args.warmup)
                ahead = Prefetcher(stream, depth=2)
                try:
                    times["loader, prefetch"] += _per_step(trainer, ahead, args.steps, args.warmup)
                finally:
                    ahead.close()
                times["loader, inline"] += _per_step(trainer, stream, args.steps, args.warmup)
    finally:
        shutdown()
    median = {name: statistics.median(t) for name, t in times.items()}
    load_ms = args.sample_ms * BATCH
    print(f"byte LM, 1F1B, PP=2, 4 microbatches, batch {BATCH} x {SEQ} tokens; loading a batch costs {load_ms:.0f} ms")
    print()
    print("| data | median ms per step | vs fixed batch |")
    print("| --- | --- | --- |")
    for name, seconds in median.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / median['fixed batch']:.2f} |")


if __name__ == "__main__":
    main()
