"""The runtimes are interchangeable: the ``local`` runtime (every rank a thread of this process)
computes exactly what the ``ray`` runtime (one Ray actor per rank) computes, bit for bit, and
``piper check`` passes on it.

Core cases: every library schedule, data parallelism with ZeRO-3, tensor and expert
parallelism, and checkpoints written under one runtime and read under the other. Each case
trains the same model on the same batches under both runtimes, keeping every gradient, and
compares every microbatch loss, every gradient and every parameter with ``torch.equal``. The
``torchrun`` runtime's cases are in ``test_torchrun.py`` (processes of their own).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from piper_directives import build_schedule
from piper_runtime import OptimizerSpec
from piper_train import Trainer
from piper_train.check import run_check
from piper_train.models import build_model

pytestmark = pytest.mark.usefixtures("ray_cluster")
ADAMW = OptimizerSpec("adamw", 1e-2)
STEPS = 2

# (model, schedule, pp, stages, parallel degrees)
CASES = [
    ("mlp", "gpipe", 2, 2, {}),
    ("mlp", "1f1b", 2, 2, {}),
    ("mlp", "interleaved_1f1b", 2, 4, {}),
    ("mlp", "zb1p", 2, 2, {}),
    ("mlp", "dualpipe", 2, 2, {}),
    ("transformer", "dualpipev", 2, 4, {}),
    ("transformer", "1f1b", 2, 2, {"dp": 2, "zero": 3}),
    ("transformer", "1f1b", 1, 1, {"tp": 2}),
    ("moe", "gpipe", 2, 2, {"ep": 2}),
]
IDS = [f"{m}-{s}-pp{pp}" + "".join(f"-{k}{v}" for k, v in d.items()) for m, s, pp, _, d in CASES]


def _train(runtime: str, model: str, schedule: str, pp: int, stages: int, degrees: dict) -> dict:
    spec = build_model(model, stages=stages, seed=5)
    strategy = build_schedule(schedule, pp, 4, stages=stages, **degrees)
    with Trainer(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, strategy,
                 optimizer=ADAMW, runtime=runtime, seed=3) as trainer:
        results = [trainer.step(*spec.batches(step), keep_grads=True) for step in range(STEPS)]
        return {
            "losses": [r.losses for r in results],
            "grads": [r.grads for r in results],
            "params": trainer.parameters(),
        }


def _assert_equal(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"]
    for g, w in zip(got["grads"], want["grads"], strict=True):
        assert g.keys() == w.keys()
        assert all(torch.equal(g[k], w[k]) for k in g), [k for k in g if not torch.equal(g[k], w[k])]
    assert got["params"].keys() == want["params"].keys()
    assert all(torch.equal(got["params"][k], want["params"][k]) for k in got["params"])


@pytest.mark.parametrize(("model", "schedule", "pp", "stages", "degrees"), CASES, ids=IDS)
def test_local_equals_ray(model: str, schedule: str, pp: int, stages: int, degrees: dict) -> None:
    _assert_equal(_train("local", model, schedule, pp, stages, degrees),
                  _train("ray", model, schedule, pp, stages, degrees))


@pytest.mark.parametrize(("model", "schedule", "pp", "stages", "degrees"), CASES, ids=IDS)
def test_check_passes_on_local(model: str, schedule: str, pp: int, stages: int, degrees: dict) -> None:
    workload = build_model(model, stages=stages, seed=11, dtype=torch.float64)
    report = run_check(workload, build_schedule(schedule, pp, 4, stages=stages, **degrees), optimizer=ADAMW,
                       steps=2, rtol=1e-9, atol=1e-12, runtime="local")
    assert report.ok, report.failures()


def test_checkpoint_moves_between_runtimes(tmp_path: Path) -> None:
    """Saved under ``local``, resumed under ``ray`` (and the other way round): the steps after
    the checkpoint are those of a run that never stopped, bit for bit."""
    spec = build_model("transformer", stages=2, seed=5)
    strategy = build_schedule("1f1b", 2, 4, stages=2, dp=2, zero=1)

    def trainer(runtime: str) -> Trainer:
        return Trainer(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, strategy,
                       optimizer=ADAMW, runtime=runtime, seed=3)

    with trainer("local") as whole:
        straight = [whole.step(*spec.batches(step)).losses for step in range(4)]
    for first, second in (("local", "ray"), ("ray", "local")):
        path = tmp_path / f"{first}-to-{second}"
        with trainer(first) as before:
            for step in range(2):
                before.step(*spec.batches(step))
            before.state.step = 2
            before.save_checkpoint(path)
        with trainer(second) as after:
            after.load_checkpoint(path)
            assert [after.step(*spec.batches(step)).losses for step in (2, 3)] == straight[2:], (first, second)
