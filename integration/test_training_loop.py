"""The training-loop basics against single-device training, on Ray (gloo, CPU).

- ``piper check`` with gradient clipping active (every step's norm above the clipping norm),
  a warm-up + cosine learning-rate schedule, weight decay (matrices only) and a held-out
  evaluation, under 1F1B, DualPipeV, DP=2 x ZeRO-3, TP=2 and EP=2: losses, clipped gradients,
  gradient norms, learning rates, parameters and the held-out loss match one device (fp32,
  SGD, the command's default tolerance);
- AdamW with weight decay on ZeRO-1/2/3 shards that mix decayed weights and undecayed
  biases, and DualPipe's mirrors with ZeRO-2, in fp64 within rtol 1e-9;
- a trainer that evaluates between steps (a forward-only program on the same workers,
  ZeRO-3 gathers included) and keeps training exactly, and refuses a batch of another size
  (in a call of several steps too, counting none of them).
"""

from __future__ import annotations

import json

import pytest
import torch

from piper_directives import build_schedule
from piper_runtime import OptimizerSpec
from piper_train import call_size
from piper_train.check import run_check
from piper_train.cli import main
from piper_train.loop import fit
from piper_train.models import build_model
from piper_train.reference import ReferenceTrainer
from piper_train.schedule import LRSchedule
from piper_train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("ray_cluster")
CLIP = 0.05
LOOP = ["--clip-grad-norm", str(CLIP), "--lr-schedule", "cosine", "--warmup-steps", "1", "--weight-decay", "0.1",
        "--optimizer", "sgd", "--lr", "0.2", "--steps", "3", "--eval-batches", "1", "--json"]


@pytest.mark.parametrize(
    "strategy",
    [
        ["--model", "mlp", "--schedule", "1f1b", "--pp", "2"],
        ["--model", "mlp", "--schedule", "dualpipev", "--pp", "2"],
        ["--model", "mlp", "--schedule", "1f1b", "--pp", "2", "--dp", "2", "--zero", "3"],
        ["--model", "transformer", "--schedule", "1f1b", "--pp", "2", "--tp", "2", "--microbatches", "2"],
        ["--model", "moe", "--schedule", "1f1b", "--pp", "2", "--ep", "2", "--microbatches", "2"],
    ],
    ids=["1f1b", "dualpipev", "dp2-zero3", "tp2", "ep2"],
)
def test_check_with_clipping_schedule_decay_and_evaluation(strategy, capsys) -> None:
    code = main(["check", *strategy, *LOOP])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["ok"] and report["schema"] == 1 and report["command"] == "check"
    assert len(report["grad_norms"]) == 3 and min(report["grad_norms"]) > CLIP  # clipping was active
    assert report["max_grad_norm_rel"] < 1e-5 and report["max_eval_rel"] < 1e-5
    assert "held-out batch 0" in err


@pytest.mark.parametrize(
    ("schedule", "pp", "microbatches", "stages", "zero"),
    [("gpipe", 1, 2, 2, 1), ("gpipe", 1, 2, 2, 2), ("gpipe", 1, 2, 2, 3), ("dualpipe", 2, 4, 2, 2)],
)
def test_decay_groups_on_zero_shards_match_one_device(schedule, pp, microbatches, stages, zero) -> None:
    """Each bucket holds a Linear's weight (decays) and bias (does not), so its shards are
    stepped as pieces; clipping counts the shards' elements, DualPipe's mirrors once."""
    workload = build_model("mlp", stages=stages, seed=3, dtype=torch.float64)
    report = run_check(
        workload, build_schedule(schedule, pp, microbatches, stages=stages, dp=2, zero=zero), steps=3,
        optimizer=OptimizerSpec("adamw", 1e-2, weight_decay=0.5), lr_schedule=LRSchedule("linear", 1, 4, 1e-3),
        clip_grad_norm=0.1, rtol=1e-9, atol=1e-12,
    )
    assert report.ok, report.failures()
    assert min(report.grad_norms) > 0.1


def test_evaluation_between_steps_leaves_training_exact() -> None:
    workload = build_model("mlp", stages=2, seed=5, dtype=torch.float64)
    optimizer = OptimizerSpec("adamw", 1e-2, weight_decay=0.1)
    strategy = build_schedule("gpipe", 1, 2, stages=2, dp=2, zero=3)  # evaluation gathers the shards too
    reference = ReferenceTrainer(workload.model, workload.loss_fn, optimizer, 2)
    with Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn, strategy,
                 optimizer=optimizer) as trainer:
        for step in range(2):
            got, want = trainer.step(*workload.batches(step)), reference.step(*workload.batches(step))
            assert got.loss == pytest.approx(want.loss, rel=1e-12)
            held_out = workload.eval_batches(step)
            assert trainer.evaluate(*held_out) == pytest.approx(reference.evaluate(*held_out), rel=1e-12)
        assert trainer.state.step == 2 and trainer.state.samples == 2 * trainer.batch_size
        inputs, targets = workload.batches(9)
        smaller = (inputs[0][:7],), (targets[0][:7],)  # another size trains too: pieces 2, 2 | 2, 1
        got, want = trainer.step(*smaller), reference.step(*smaller)
        assert got.loss == pytest.approx(want.loss, rel=1e-12) and trainer.plans == 3
        assert trainer.state.step == 3 and trainer.state.samples == 2 * trainer.batch_size + 7
        held_out = workload.eval_batches(5)
        smaller = (held_out[0][0][:7],), (held_out[1][0][:7],)  # evaluation takes other sizes too
        assert trainer.evaluate(*smaller) == pytest.approx(reference.evaluate(*smaller), rel=1e-12)
        with pytest.raises(ValueError, match=r"pieces have shapes input:0 4x31.*capturing the model"):
            trainer.evaluate((torch.zeros(16, 31, dtype=torch.float64),), targets)
        lr = trainer.state.lr.state_dict()
        with pytest.raises(ValueError, match=r"pieces have shapes input:0 4x31.*capturing the model"):  # the 2nd
            trainer.submit_steps([workload.batches(2), ((torch.zeros(16, 31, dtype=torch.float64),), targets)])
        assert trainer.state.step == 3 and trainer.state.lr.state_dict() == lr  # nothing was sent or counted
        params = trainer.parameters()
    for name, p in reference.parameters().items():
        torch.testing.assert_close(params[name], p, rtol=1e-9, atol=1e-12)


def test_fit_sizes_its_calls_automatically_and_still_matches_one_device(monkeypatch) -> None:
    """``steps_per_call="auto"`` (the default): single steps while the first three are
    timed, then as many steps per call as the pace allows (here, with the call's target made
    huge, the cap or what is left), and no more batches than ``AUTO_CALL_BYTES`` hold; every
    step is still the one-device step."""
    monkeypatch.setattr(call_size, "AUTO_CALL_S", 1e6)
    workload = build_model("mlp", stages=2, seed=3, dtype=torch.float64)
    optimizer = OptimizerSpec("adam", 1e-2)
    reference = ReferenceTrainer(workload.model, workload.loss_fn, optimizer, 4)
    with Trainer.with_schedule(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
                               schedule="1f1b", pp=2, microbatches=4, optimizer=optimizer) as trainer:
        run = fit(trainer, [workload.batches(k) for k in range(9)], steps=9)  # a list: fit reads it
        # Calls of two batches at most: the byte limit is what two batches weigh.
        inputs, targets = workload.batches(0)
        monkeypatch.setattr(call_size, "AUTO_CALL_BYTES", 2 * sum(t.nbytes for t in (*inputs, *targets)))
        more = fit(trainer, iter([workload.batches(k) for k in range(9, 17)]), steps=17)
        params = trainer.parameters()
    # A call is sent while the one before it runs: the fifth is the first sized by the pace.
    assert run.calls == (1, 1, 1, 1, 5)
    assert more.calls == (1, 1, 1, 1, 2, 2)
    for k, metrics in enumerate(run.steps + more.steps):
        assert metrics.loss == pytest.approx(reference.step(*workload.batches(k)).loss, rel=1e-10)
    for name, p in reference.parameters().items():
        torch.testing.assert_close(params[name], p, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("steps_per_call", "calls"), [(1, [[1], [2], [3], [4], [5]]), (3, [[1, 2], [3, 4], [5]])])
def test_fit_with_a_step_in_flight_ahead_matches_one_device(steps_per_call, calls) -> None:
    """``fit`` sends each step (or call of ``steps_per_call`` steps) before the previous
    one's result is in (and holds back before an evaluation, where a call ends early):
    losses, held-out losses and parameters match one device; memory is accounted on steps
    1, 2 and every ``memory_every``-th only, the others repeating the latest peaks."""
    workload = build_model("mlp", stages=2, seed=7, dtype=torch.float64)
    optimizer = OptimizerSpec("adamw", 1e-2)
    reference = ReferenceTrainer(workload.model, workload.loss_fn, optimizer, 4)
    seen: list[tuple[int, float, bool, tuple[int, ...]]] = []

    class Record:
        def on_step(self, metrics, result) -> None:
            seen.append((metrics.step, metrics.loss, bool(result.memory), metrics.peak_memory_bytes))

        def on_eval(self, metrics) -> None:
            seen.append((metrics.step, metrics.loss, False, ()))

        def close(self) -> None:
            pass

    batches = iter([workload.batches(k) for k in range(5)])
    with Trainer.with_schedule(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
                               schedule="1f1b", pp=2, microbatches=4, optimizer=optimizer) as trainer:
        sent: list[list[int]] = []
        submit_steps = trainer.submit_steps

        def record_calls(batches, **options):
            sent.append([trainer.state.step + 1 + k for k in range(len(batches))])
            return submit_steps(batches, **options)

        trainer.submit_steps = record_calls
        run = fit(trainer, batches, steps=5, held_out=workload.eval_batches, eval_every=2, sinks=[Record()],
                  memory_every=4, steps_per_call=steps_per_call)
        params = trainer.parameters()
    assert sent == calls
    want = []
    for k in range(5):
        want.append((k + 1, reference.step(*workload.batches(k)).loss))
        if (k + 1) % 2 == 0:
            want.append((k + 1, reference.evaluate(*workload.eval_batches(0))))
    assert [s for s, *_ in seen] == [s for s, _ in want]
    for (_, got, *_), (_, expected) in zip(seen, want, strict=True):
        assert got == pytest.approx(expected, rel=1e-10)
    steps = [row for row in seen if row[3]]
    assert [s for s, _, accounted, _ in steps if accounted] == [1, 2, 4] and len(steps) == 5
    assert steps[2][3] == steps[1][3] and all(len(row[3]) == 2 for row in steps)  # step 3 repeats step 2's peaks
    assert len(run.steps) == 5 and len(run.evals) == 2
    for name, p in reference.parameters().items():
        torch.testing.assert_close(params[name], p, rtol=1e-9, atol=1e-12)
