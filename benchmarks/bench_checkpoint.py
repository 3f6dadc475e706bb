"""Checkpoints and restarts, measured: size and time of a sharded save and of a resharded load,
then the time from a killed worker to training again, on new workers (no worker pool).

1. ``--model`` (default ``lm``, the byte LM) under ``--schedule`` on ``--pp`` x ``--dp`` ranks
   with ZeRO ``--zero`` (default DualPipeV, PP=2 x DP=2, ZeRO-3) trains ``--steps`` steps with
   AdamW and saves: bytes on disk (every rank's file, the index and the manifest) and seconds to write.
2. A trainer under 1F1B on ``--pp`` x ``--dp`` ranks without ZeRO loads it (resharding):
   seconds to load.
3. Restart: 1F1B on ``--pp`` ranks, ``--steps`` steps with a checkpoint every ``--every``;
   one worker is SIGKILLed after step ``--kill-after``. It prints when the driver noticed
   (the next step's ``ExecutionError``), how long new workers and the checkpoint load took,
   the time from the kill until the next step began, and the steps recomputed.

Workers are new in every trainer (``reuse_workers=False``): what a real restart pays. No
timing is asserted anywhere: this is a measurement (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

from piper_directives import build_schedule
from piper_runtime import OptimizerSpec, ensure_ray, shutdown
from piper_train.checkpoints import Checkpoints
from piper_train.loop import fit
from piper_train.models import build_model
from piper_train.trainer import Trainer


class KillAfter:
    """A sink that SIGKILLs rank 1's worker after step ``step`` and notes when the run is
    training again (the first step after the restart begins)."""

    def __init__(self, trainer: Trainer, step: int) -> None:
        self.trainer, self.step = trainer, step
        self.killed_at: float | None = None
        self.training_again: float | None = None

    def on_step(self, metrics, result) -> None:
        if self.killed_at is not None and self.training_again is None:
            self.training_again = time.perf_counter() - metrics.step_seconds - metrics.data_seconds
        if metrics.step == self.step and self.killed_at is None:
            os.kill(self.trainer.worker_pids()[1], signal.SIGKILL)
            self.killed_at = time.perf_counter()

    def on_eval(self, metrics) -> None:
        pass

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lm")
    parser.add_argument("--schedule", default="dualpipev")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=5)
    args = parser.parse_args()
    ensure_ray(num_cpus=16)
    stages = 2 * args.pp if args.schedule.startswith("dualpipe") else args.pp
    workload = build_model(args.model, stages=stages, seed=0)
    optimizer = OptimizerSpec("adamw", 1e-3, weight_decay=0.1)

    def trainer(strategy) -> Trainer:
        return Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
                       strategy, optimizer=optimizer, reuse_workers=False)

    params = sum(p.numel() for p in workload.model.parameters())
    with tempfile.TemporaryDirectory() as root:
        saving = build_schedule(args.schedule, args.pp, 4, stages=stages, dp=args.dp, zero=args.zero)
        with trainer(saving) as t:
            fit(t, workload.stream(), steps=args.steps)
            began = time.perf_counter()
            path = t.save_checkpoint(Path(root) / "ckpt" / "step")
            save_s = time.perf_counter() - began
        files = sorted(path.iterdir())
        size = sum(f.stat().st_size for f in files)
        print(f"{args.model}: {params} parameters; {args.schedule} PP={args.pp} x DP={args.dp} ZeRO-{args.zero}: "
              f"checkpoint of {size / 2**20:.2f} MiB in {len(files)} files ({', '.join(f.name for f in files)}), "
              f"written in {save_s:.2f} s")
        with trainer(build_schedule("1f1b", args.pp, 4, stages=stages, dp=args.dp, zero=0)) as t:
            t.state.data = workload.stream()
            began = time.perf_counter()
            t.load_checkpoint(path)
            print(f"loaded under 1F1B PP={args.pp} x DP={args.dp} ZeRO-0 (resharded) in "
                  f"{time.perf_counter() - began:.2f} s")

        with trainer(build_schedule("1f1b", args.pp, 4, stages=stages)) as t:
            sink = KillAfter(t, args.kill_after)
            run = fit(t, workload.stream(), steps=args.steps + args.kill_after,
                      checkpoints=Checkpoints(Path(root) / "restart", args.every), sinks=[sink], max_restarts=1)
        (r,) = run.restarts
        assert sink.killed_at is not None and sink.training_again is not None
        print(f"1F1B PP={args.pp}, checkpoint every {args.every}: killed a worker after step {args.kill_after}; "
              f"new workers and checkpoint {r.resumed_from} loaded in {r.seconds:.2f} s; training again "
              f"{sink.training_again - sink.killed_at:.2f} s after the kill; {r.recomputed} steps recomputed")
    shutdown()


if __name__ == "__main__":
    main()
