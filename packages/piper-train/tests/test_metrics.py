"""Metrics records and sinks (no workers): standard JSON lines with a schema, plain progress
lines off a terminal, TensorBoard refused clearly without its package; the TrainState a
checkpoint saves, restored."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch

from piper_runtime import StepResult
from piper_train.batches import BatchStream
from piper_train.metrics import (
    SCHEMA,
    CheckpointMetrics,
    EvalMetrics,
    JsonlWriter,
    Progress,
    StepMetrics,
    TensorBoardWriter,
    WandbWriter,
    dumps,
)
from piper_train.schedule import LearningRate, LRSchedule
from piper_train.state import TrainState

STEP = StepMetrics(
    step=3, epoch=0, loss=float("nan"), lr=1e-3, grad_norm=float("inf"), step_seconds=0.02, data_seconds=0.001,
    samples_per_s=800.0, tokens_per_s=51200.0, peak_memory_bytes=(2**20, 3 * 2**20), eta_seconds=65.0,
    total_steps=10,
)


def _strict(line: str) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=refuse)


def test_jsonl_is_standard_json_with_a_schema(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    writer = JsonlWriter(path)
    writer.on_step(STEP, StepResult((0.5,), 0.5))
    writer.on_eval(EvalMetrics(3, 0.25, 2, 0.1))
    writer.on_checkpoint(CheckpointMetrics(3, "ck/step-00000003", 5 * 2**20, 0.4, 0.1))
    writer.close()
    step, ev, ck = (_strict(line) for line in path.read_text().splitlines())
    assert step["schema"] == SCHEMA and step["kind"] == "step" and step["step"] == 3
    assert step["loss"] == "NaN" and step["grad_norm"] == "Infinity"  # NaN and inf are not JSON numbers
    assert step["peak_memory_bytes"] == [2**20, 3 * 2**20] and step["tokens_per_s"] == 51200.0
    assert ev == {"schema": SCHEMA, "kind": "eval", "step": 3, "loss": 0.25, "batches": 2, "seconds": 0.1}
    assert ck == {"schema": SCHEMA, "kind": "checkpoint", "step": 3, "path": "ck/step-00000003", "bytes": 5 * 2**20,
                  "seconds": 0.4, "waited_seconds": 0.1}
    assert _strict(dumps({"x": [math.nan, 1.0]})) == {"x": ["NaN", 1.0]}
    with pytest.raises(ValueError, match="cannot write metrics"):
        JsonlWriter(tmp_path / "missing" / "m.jsonl")


def test_progress_prints_plain_lines_off_a_terminal() -> None:
    out = io.StringIO()
    progress = Progress(out)
    assert not progress.bar
    progress.on_step(StepMetrics(1, 0, 2.5, 3e-3, 0.7, 0.05, 0.0, 320.0, None, (2**20,), 1.0, 20), StepResult((2.5,), 2.5))
    progress.on_eval(EvalMetrics(1, 2.0, 4, 0.3))
    progress.on_checkpoint(CheckpointMetrics(1, "ck/step-00000001", 3 * 2**19, 0.25, 0.25))
    progress.on_checkpoint(CheckpointMetrics(2, "ck/step-00000002", 3 * 2**19, 0.25, 0.05))  # written meanwhile
    progress.close()
    step, ev, ck, written_meanwhile = out.getvalue().splitlines()
    assert step.startswith("step    1/20  loss   2.5000  lr 0.003  grad norm 0.7")
    assert "50.0 ms/step" in step and "320 samples/s" in step and "peak 1.0 MiB/rank" in step and "eta 0:00:01" in step
    assert ev == "eval after step 1: loss 2.0000 over 4 held-out batches (0.30 s)"
    assert ck == "checkpoint after step 1: ck/step-00000001 (1.5 MiB in 0.25 s)"
    assert written_meanwhile == "checkpoint after step 2: ck/step-00000002 (1.5 MiB in 0.25 s; the steps waited 0.05 s)"


def test_progress_draws_a_bar_when_asked() -> None:
    out = io.StringIO()
    progress = Progress(out, bar=True)  # what a terminal gets (tqdm is a dependency)
    progress.on_step(StepMetrics(1, 0, 2.5, 3e-3, None, 0.05, 0.0, 320.0, 1000.0, (2**20,), 1.0, 4), StepResult((2.5,), 2.5))
    progress.on_eval(EvalMetrics(1, 2.0, 4, 0.3))
    progress.close()
    text = out.getvalue()
    assert "1/4" in text and "loss=2.5000" in text and "tok/s=1,000" in text and "eval after step 1" in text


def test_tensorboard_without_its_package_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ValueError, match=r"--tensorboard runs: the tensorboard package is not installed"):
        TensorBoardWriter("runs")


def test_tensorboard_scalars(tmp_path) -> None:
    pytest.importorskip("tensorboard")  # an optional dependency (piper-train[tensorboard])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(tmp_path)
    writer.on_step(StepMetrics(1, 0, 2.5, 3e-3, 0.7, 0.05, 0.0, 320.0, None, (2**20, 2**21), 1.0, 4),
                   StepResult((2.5,), 2.5))
    writer.on_eval(EvalMetrics(1, 2.0, 4, 0.3))
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/loss", "train/peak_memory_mib/rank1"} <= tags
    assert "train/tokens_per_s" not in tags
    assert events.Scalars("train/peak_memory_mib/rank1")[0].value == 2.0


class _Wandb:
    """What ``WandbWriter`` calls of the ``wandb`` module, recorded."""

    class Settings:
        def __init__(self, **kwargs: object) -> None:
            self.kwargs = kwargs

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []
        self.finished = 0

    def init(self, **kwargs: object) -> _Wandb:
        self.inits.append(kwargs)
        return self

    def log(self, values: dict, step: int) -> None:
        self.logged.append((values, step))

    def finish(self) -> None:
        self.finished += 1


def test_wandb_gets_the_jsonl_records_at_their_steps() -> None:
    wandb = _Wandb()
    writer = WandbWriter("piper/run-1", {"schedule": "1f1b", "pp": 2}, wandb=wandb)
    writer.on_step(STEP, StepResult((0.5,), 0.5))
    writer.on_eval(EvalMetrics(3, 0.25, 2, 0.1))
    writer.on_checkpoint(CheckpointMetrics(3, "ck/step-00000003", 5 * 2**20, 0.4, 0.1))
    writer.close()
    (init,) = wandb.inits
    assert (init["project"], init["name"], init["config"]) == ("piper", "run-1", {"schedule": "1f1b", "pp": 2})
    assert init["settings"].kwargs == {"console": "off"}  # stdout stays Piper's (--json)
    (step, at), (ev, eval_at), (ck, ck_at) = wandb.logged
    assert at == eval_at == ck_at == 3
    assert math.isnan(step["train/loss"]) and step["train/grad_norm"] == math.inf  # as they are
    assert step["train/lr"] == 1e-3 and step["train/tokens_per_s"] == 51200.0
    assert step["train/peak_memory_mib/rank1"] == 3.0 and "train/step" not in step
    assert ev == {"eval/loss": 0.25, "eval/batches": 2, "eval/seconds": 0.1}
    assert ck == {"checkpoint/bytes": 5 * 2**20, "checkpoint/seconds": 0.4, "checkpoint/waited_seconds": 0.1}
    assert wandb.finished == 1
    assert WandbWriter("piper", {}, wandb=wandb) and wandb.inits[-1]["name"] is None


def test_wandb_without_its_package_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(ValueError, match=r"--wandb p/r: the wandb package is not installed"):
        WandbWriter("p/r", {})


def test_train_state_round_trips_step_schedule_data_and_rng() -> None:
    def stream() -> BatchStream:
        return BatchStream(lambda k: ((torch.full((2, 1), float(k)),), (torch.zeros(2, 1),)))

    state = TrainState(LearningRate(1.0, LRSchedule("cosine", 1, 6)))
    state.data = stream()
    for _ in range(3):
        next(state.data)
        state.advance(samples=2, tokens=0)
    saved = state.state_dict()
    expected = (state.lr.current, next(state.data)[0][0][0, 0].item(), torch.rand(1))
    restored = TrainState(LearningRate(1.0, LRSchedule("cosine", 1, 6)))
    restored.data = stream()
    restored.load_state_dict(saved)
    assert (restored.step, restored.samples) == (3, 6)
    got = (restored.lr.current, next(restored.data)[0][0][0, 0].item(), torch.rand(1))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
