"""``examples/gpt2``: it captures (tied head, dropout, autocast) and learns on one device.

``piper check`` passes under 1F1B and DualPipeV on two pipeline ranks and under 1F1B with
``--dp 2 --zero 3``, dropout on and the head tied; a strategy that cannot keep the tied
copies equal is refused by both module paths.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from piper_directives import capture
from piper_directives.randomness import Randomness
from piper_runtime import OptimizerSpec
from piper_train.reference import ReferenceTrainer
from piper_train.workload import load_workload

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt2" / "model.py"


@pytest.fixture(scope="module")
def gpt2():
    spec = importlib.util.spec_from_file_location("gpt2_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt2_example"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("factory", "logits"), [("factory", "float32"), ("factory_bf16", "bfloat16")])
def test_the_example_captures_with_its_tie_and_its_precision(factory, logits):
    workload = load_workload(f"{EXAMPLE}:{factory}", stages=4)
    assert workload.example_inputs[0].shape == (16, 64)
    assert not torch.equal(workload.batches(1)[0][0], workload.batches(0)[0][0])  # new text every step
    captured = capture(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn)
    graph = captured.graph
    assert [s.tags.as_dict() for s in graph.stage_segments()] == [{"PP": i} for i in range(4)]
    (tie,) = graph.ties
    assert tie.name == "transformer.wte.weight"
    assert tie.holders == (("s0", "transformer.wte.weight"), ("s3", "lm_head.weight"))
    (out,) = graph.segment_by_id["s3"].outputs
    assert graph.value_by_name[out].meta.dtype == logits  # the head runs under autocast in bf16
    assert captured.user_modules == ("piper_user_model",)


def test_it_learns_on_one_device_with_seeded_dropout(gpt2):
    """Single-device sanity: the reference trainer, drawing dropout as the segments will,
    brings the byte-level loss from ln(256) down on the standard library's text."""
    model, inputs, targets, loss_fn, batches = gpt2.make(gpt2.GPTConfig(n_layer=2, n_embd=32, block_size=32), batch=8)
    captured = capture(model, (inputs,), (targets,), loss_fn)
    trainer = ReferenceTrainer(model, loss_fn, OptimizerSpec("adamw", 1e-2), 2,
                               randomness=Randomness(0, captured.runs))
    losses = []
    for step in range(15):
        x, y = batches(step)
        losses.append(trainer.step((x,), (y,)).loss)
    assert abs(losses[0] - 5.545) < 0.25  # about ln(256): nearly uniform logits at the start
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


@pytest.mark.parametrize(
    "strategy",
    [
        ("--schedule", "1f1b", "--pp", "2"),
        ("--schedule", "dualpipev", "--pp", "2"),
        ("--schedule", "1f1b", "--pp", "2", "--dp", "2", "--zero", "3"),
    ],
    ids=["1f1b", "dualpipev", "1f1b-dp2-zero3"],
)
def test_piper_check_passes_with_the_tied_head_and_dropout_on(piper, strategy):
    """The tied head trains as one parameter and dropout draws one device's masks: the
    strategy matches single-device training at the default tolerances."""
    done = piper("check", "--model", f"{EXAMPLE}:tiny", *strategy, "--microbatches", "4", "--steps", "2", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["ok"]


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_bf16_under_a_pipeline_is_bit_for_bit_single_device_bf16(piper, schedule):
    """--precision bf16: the reference runs the same casts (one cast copy per use of the tied
    weight, as the two holders make) on the workers' thread count, so a pipeline, whose sums
    are those of one device, gives exactly its numbers (docs/precision.md). On the local
    runtime too, whose rank threads each set torch's threads as a worker process does
    (DualPipeV differed by 3e-2 before they did)."""
    done = piper("check", "--model", f"{EXAMPLE}:tiny", "--schedule", schedule, "--pp", "2", "--microbatches", "4",
                 "--steps", "2", "--precision", "bf16", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"] and summary["max_loss_abs"] == summary["max_grad_abs"] == summary["max_param_abs"] == 0.0


def test_a_strategy_that_cannot_keep_the_copies_equal_is_refused_by_both_module_paths(piper):
    """DualPipe shards each direction's replicas apart under ZeRO-2: the tie is refused with
    exit 2, naming both holders' module paths, before any worker starts."""
    done = piper("check", "--model", f"{EXAMPLE}:tiny", "--schedule", "dualpipe", "--pp", "2", "--dp", "2",
                 "--zero", "2", "--microbatches", "4", "--steps", "1")
    assert done.returncode == 2, done.stdout + done.stderr
    text = done.stderr
    assert "parameter 'transformer.wte.weight' is tied" in text and "DualPipe with ZeRO-2/3" in text
    assert "module 'transformer.wte'" in text and "module 'lm_head'" in text and "model.py" in text
