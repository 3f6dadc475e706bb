"""``examples/gpt2``: it captures (tied head, dropout, autocast) and learns on one device.

Strategy runs (pipeline, DualPipeV, ZeRO-3) come with the runtime's tied-gradient sum; until
then the front door refuses the tie by name, which is tested here too.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from piper_directives import capture, one_f_one_b
from piper_directives.randomness import Randomness
from piper_ir import DirectiveError
from piper_runtime import OptimizerSpec
from piper_train.reference import ReferenceTrainer
from piper_train.trainer import Trainer
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


def test_the_trainer_refuses_the_tie_by_both_module_paths():
    workload = load_workload(f"{EXAMPLE}:factory", stages=4)
    with pytest.raises(DirectiveError) as err:
        Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
                one_f_one_b(2, 2, stages=4))
    text = str(err.value)
    assert "'transformer.wte.weight' in s0" in text and "'lm_head.weight' in s3" in text
    assert "module 'transformer.wte'" in text and "module 'lm_head'" in text and "model.py" in text


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


@pytest.mark.usefixtures("ray_cluster")
def test_piper_train_refuses_the_tie_with_exit_2_and_no_traceback(piper):
    done = piper("train", "--model", f"{EXAMPLE}:factory", "--pp", "2", "--steps", "1")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "parameter 'transformer.wte.weight' is tied" in done.stderr and "'lm_head.weight' in s3" in done.stderr
    assert "Traceback" not in done.stderr
