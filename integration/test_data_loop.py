"""``piper train`` on a user's data (in process, on the session's Ray): a Dataset batched by
``--batch-size`` for ``--epochs`` with its partial last batch trained, held-out evaluation
every few steps, per-step metrics as JSON lines, the timeline of one step (also with three
steps per call to the workers); a data source whose feature size changes (which the model
cannot take, unlike another batch size or sequence length) is refused, naming the shapes; a
missing optional dependency is refused before any worker starts. Where each rank's batch
values go is checked without processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from piper_directives import build_schedule
from piper_directives.synthetic import synthetic_graph
from piper_runtime.batch import batch_reads, check_batch, from_wire, replica_slice
from piper_runtime.driver.runtime import _shipments
from piper_scheduler import compile_program
from piper_train.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "data_model.py"


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("steps_per_call", ["1", "3"])  # 3: calls of steps [1-3], [4-6], [7-9], [10]
def test_epochs_of_a_dataset_with_evaluation_metrics_and_a_profile(tmp_path, capsys, steps_per_call) -> None:
    metrics = tmp_path / "metrics.jsonl"
    code = main(["train", "--model", f"{FIXTURE}:make", "--batch-size", "8", "--epochs", "2", "--pp", "2",
                 "--microbatches", "2", "--eval-every", "3", "--eval-batches", "2", "--metrics", str(metrics),
                 "--profile-step", "2", "--profile-dir", str(tmp_path / "profile"), "--json",
                 "--steps-per-call", steps_per_call])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)
    # 36 samples: 4 full batches of 8 per epoch and the partial batch of 4 (it trains), 2 epochs.
    assert (summary["steps"], summary["epochs"], summary["schema"], summary["command"]) == (10, 2, 1, "train")
    assert [e["step"] for e in summary["eval"]] == [3, 6, 9]
    # The partial batch's pieces (2 samples, not 4) compiled a second program, once.
    assert summary["plans"] == 2 and len(summary["plan_compile_seconds"]) == 1
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 11)) and [r["epoch"] for r in steps] == [0] * 5 + [1] * 5
    assert all(r["samples_per_s"] > 0 and len(r["peak_memory_bytes"]) == 2 and r["tokens_per_s"] is None for r in steps)
    assert steps[-1]["eta_seconds"] == 0 and steps[0]["total_steps"] == 10 and steps[-1]["plans"] == 2
    assert [r["loss"] for r in records if r["kind"] == "eval"] == [e["loss"] for e in summary["eval"]]
    trace = json.loads((tmp_path / "profile" / "step2.trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert (tmp_path / "profile" / "step2.png").stat().st_size > 0
    assert "eval after step 3" in err and "step   10/10" in err


@pytest.mark.usefixtures("ray_cluster")
def test_a_dataloader_for_a_number_of_steps_and_shapes_that_vary(capsys) -> None:
    code = main(["train", "--model", f"{FIXTURE}:loader", "--steps", "6", "--pp", "2", "--microbatches", "2",
                 "--lr-schedule", "step", "--lr-step-size", "2", "--lr-gamma", "0.5", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)
    assert summary["steps"] == 6 and summary["epochs"] == 2  # 4 full batches per epoch
    assert summary["lrs"] == pytest.approx([3e-3, 3e-3, 1.5e-3, 1.5e-3, 7.5e-4, 7.5e-4])
    code = main(["train", "--model", f"{FIXTURE}:varying", "--steps", "4", "--pp", "2", "--microbatches", "2"])
    err = capsys.readouterr().err
    assert code == 2
    # Another feature size: the model cannot take it, so no program compiles for it.
    assert "a batch whose pieces have shapes input:0 4x7, target:0 4x6" in err and "Traceback" not in err


def test_missing_tensorboard_and_bad_flags_are_refused_before_workers_start(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails
    code = main(["train", "--model", "mlp", "--steps", "1", "--tensorboard", str(tmp_path / "tb")])
    assert code == 2 and "the tensorboard package is not installed" in capsys.readouterr().err
    code = main(["train", "--model", f"{FIXTURE}:loader", "--eval-every", "2", "--steps", "1"])
    assert code == 2 and "has no held-out data" in capsys.readouterr().err
    code = main(["train", "--model", "mlp", "--epochs", "2"])
    assert code == 2 and "--epochs: the data of model mlp is a function of the step" in capsys.readouterr().err
    for argv, message in [
        (["--lr-schedule", "exponential"], "invalid choice: 'exponential'"),
        (["--lr-schedule", "step"], "--lr-schedule step needs --lr-step-size"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm must be > 0"),
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
        (["--steps-per-call", "0"], "argument --steps-per-call: must be a number >= 1 or auto, got '0'"),
        (["--steps-per-call", "2", "--on-nan", "skip-step"], "cannot be combined with --on-nan skip-step"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["train", "--model", "mlp", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_each_rank_receives_only_its_replicas_shard_of_what_it_reads() -> None:
    """PP=2 x DP=2 (1F1B): the first stage's ranks get only the inputs, the loss ranks only
    the targets, each replica its own shard of every microbatch."""
    graph = synthetic_graph(2, 2, hidden=4, batch=4)  # 8 samples: 2 microbatches x 2 replicas of 2
    program = compile_program(build_schedule("1f1b", 2, 2, stages=2, dp=2).apply(graph))
    names = {r: batch_reads(program, r) for r in range(program.world_size)}
    assert names == {0: ("input:0",), 2: ("input:0",), 1: ("target:0",), 3: ("target:0",)}
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    shipped = _shipments(program, names, check_batch(program, (x,), (y,)), lambda value: value)
    for rank, held in enumerate(shipped):
        replica = program.plan(rank).replica
        (name, wired), = held.items()
        tensor = from_wire(wired)  # as the worker takes it
        meta = program.value_by_name[name].meta
        full = x if name == "input:0" else y
        assert tensor.shape == (4, 4)  # half of the batch
        assert torch.equal(tensor, replica_slice(full, meta, 2, 2, replica))
