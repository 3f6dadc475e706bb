"""Trainers on reused Ray workers (``reuse_workers``, ``piper_runtime.WorkerPool``).

A reused worker has joined other worlds before, of other sizes and on other ports; its
results must not show it. (The runtime's own tests compare a reused worker with a new one
bit for bit and check that a failed run's workers are never reused.)
"""

from __future__ import annotations

import pytest
import ray
import torch

from piper_directives import build_schedule
from piper_runtime import OptimizerSpec, WorkerPool
from piper_train.models import build_model
from piper_train.reference import ReferenceTrainer
from piper_train.trainer import Trainer

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.ray]
SGD = OptimizerSpec("sgd", 0.05, {"momentum": 0.9})


def test_workers_reused_across_world_sizes_match_new_workers_and_one_device():
    workload = build_model("mlp", stages=2, seed=4)
    pool = WorkerPool()

    def train(dp: int) -> tuple[list[list[float]], dict[str, torch.Tensor], list[int]]:
        with Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
                     build_schedule("1f1b", 2, 4, dp=dp), optimizer=SGD, reuse_workers=pool) as trainer:
            pids = ray.get([w.ping.remote() for w in trainer.runtime._workers], timeout=30)
            losses = [trainer.step(*workload.batches(step)).losses for step in range(3)]
            return losses, trainer.parameters(), pids

    first = train(dp=1)  # two new workers
    wide = train(dp=2)  # a world of four: the two above (now ranks 0 and 1 again) and two new ones
    again = train(dp=1)  # the first two, after both worlds
    assert (pool.started, pool.reused, pool.idle) == (4, 4, 4)
    assert set(first[2]) < set(wide[2]) and again[2] == first[2]
    assert again[0] == first[0]
    assert all(torch.equal(again[1][name], p) for name, p in first[1].items())

    reference = ReferenceTrainer(workload.model, workload.loss_fn, SGD, 4)
    want = [loss for step in range(3) for loss in reference.step(*workload.batches(step)).losses]
    for losses in (first[0], wide[0]):
        assert [loss for step in losses for loss in step] == pytest.approx(want, rel=1e-5, abs=1e-6)
    pool.clear()
