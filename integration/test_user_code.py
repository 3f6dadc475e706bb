"""The user's own code reaches the Ray workers: a model file with its own loss function, a
helper module class, an expert class and a loss helper in modules next to it (item 1 of
issue 10). Without shipping them by value, every worker fails with ``No module named ...``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from piper_directives import build_schedule, capture
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import ModelSpec
from piper_train.workload import load_workload

MODEL = Path(__file__).resolve().parent / "fixtures" / "tinymoe" / "model.py"
SGD = OptimizerSpec("sgd", 0.05)


def test_the_workers_need_the_users_modules():
    """What capture says must travel: the model file (under its private name) and both
    modules next to it, none of which a worker can import."""
    workload = load_workload(f"{MODEL}:factory", stages=4)
    captured = capture(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn)
    assert captured.user_modules == ("piper_user_model", "tinymoe_layers", "tinymoe_losses")


@pytest.mark.usefixtures("ray_cluster")
def test_python_api_with_a_privately_imported_model_module():
    """A script that imports its model module from a file under a name of its own."""
    spec = importlib.util.spec_from_file_location("my_experiment_model", MODEL)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(MODEL.parent))  # the script's own folder, where the neighbours live
    try:
        sys.modules["my_experiment_model"] = module
        spec.loader.exec_module(module)
        model, x, y, loss_fn = module.factory()
    finally:
        sys.path.remove(str(MODEL.parent))
    workload = ModelSpec("tinymoe", model, (x,), (y,), loss_fn, lambda step: ((x,), (y,)), 4, 0)
    report = run_check(workload, build_schedule("1f1b", 2, 4, stages=4), optimizer=SGD, steps=2)
    assert report.ok, report.failures()
    assert [len(plan.segments()) for plan in report.program.ranks] == [2, 3]


@pytest.mark.usefixtures("ray_cluster")
def test_piper_train_with_a_model_file_and_its_neighbours(piper):
    done = piper("train", "--model", f"{MODEL}:factory", "--pp", "2", "--microbatches", "2", "--steps", "3",
                 "--optimizer", "sgd", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["pp"] == 2 and len(summary["losses"]) == 3
