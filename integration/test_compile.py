"""``--compile`` (issue 39, item 2): every segment's F, B, BI and BW as compiled functions
(piper_runtime.rank.compiled), checked against single-device eager training with
``run_check`` under every library schedule, with dropout (the masks must be eager's),
recomputation, bf16 and ZeRO-2; segments with collectives inside (tensor parallelism) are
refused. The machinery is checked with the ``aot_eager`` backend (the
traced aten graphs, run as they are); one test runs inductor's generated C++ code on the split
backward of ZB1P. Compiling happens once per segment and input shape, not per step or
microbatch (counted here)."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

from piper_directives import Recompute, Strategy, annotate, build_schedule
from piper_ir import ExecutionError
from piper_runtime import OptimizerSpec, RunOptions
from piper_runtime.rank import compiled
from piper_train.check import TOLERANCES, run_check
from piper_train.cli import main
from piper_train.models import ModelSpec, build_model
from piper_train.trainer import Trainer

ADAMW = OptimizerSpec("adamw", 1e-3)


class Dropped(nn.Module):
    """Four regions, each a Linear, tanh and dropout: a wrong mask changes every gradient."""

    def __init__(self, width: int = 8, regions: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(regions))
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            with annotate("PP"):
                x = self.drop(torch.tanh(layer(x))) + x
        return x


def _workload(seed: int = 0, regions: int = 4) -> ModelSpec:
    torch.manual_seed(seed)
    model = Dropped(regions=regions)
    batches = [(torch.randn(16, 8), torch.randn(16, 8)) for _ in range(3)]
    return ModelSpec("dropped", model, (batches[0][0],), (batches[0][1],), nn.functional.mse_loss,
                     lambda step: ((batches[step][0],), (batches[step][1],)), regions, seed)


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The backends of every graph compiled from now on (ranks are threads of this process)."""
    calls: list[str] = []
    real = compiled.compile_graph

    def counting(gm, backend):
        calls.append(backend)
        return real(gm, backend)

    monkeypatch.setattr(compiled, "compile_graph", counting)
    return calls


def _made(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str, str]]:
    """Each function compiled from now on: (its ``CompiledSegment``, its segment, F/B/BI/BW)."""
    made: list[tuple[int, str, str]] = []
    real = compiled.CompiledSegment._compile

    def recording(self, gm, what):
        made.append((id(self), self.segment, what))
        return real(self, gm, what)

    monkeypatch.setattr(compiled.CompiledSegment, "_compile", recording)
    return made


def _products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The weight gradients added inside their products (``WeightProduct.add_into``) from now on."""
    added: list[int] = []
    real = compiled.WeightProduct.add_into

    def counting(self, param):
        added.append(id(param))
        return real(self, param)

    monkeypatch.setattr(compiled.WeightProduct, "add_into", counting)
    return added


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zb1p", "dualpipe", "dualpipev"])
def test_compiled_segments_match_one_device_under_every_schedule(schedule, monkeypatch):
    """With every weight's gradient added inside its product (``grad_fusion_min_bytes=0``):
    each microbatch's backward of each region's Linear, in ``B`` or in ``BW``."""
    calls, added, made = _counted(monkeypatch), _products(monkeypatch), _made(monkeypatch)
    stages = 4 if schedule in ("interleaved_1f1b", "dualpipe", "dualpipev") else 2
    report = run_check(_workload(regions=stages), build_schedule(schedule, 2, 4, stages=stages), optimizer=ADAMW,
                       options=RunOptions.build(compile="aot_eager", runtime="local", grad_fusion_min_bytes=0))
    assert report.ok, report.failures()
    assert len(added) == 3 * 4 * stages  # steps x microbatches x regions (one Linear weight each)
    # Each rank compiles each of its segments' functions once for its one input shape (3 steps
    # x 4 microbatches would compile 12 times as many if anything were compiled per call): F;
    # B where the plan runs it; BI and BW where it splits it, or where a stage's last B of the
    # step runs as BI, then BW once its input gradient is sent (``input_grads_first``).
    assert len(made) == len(set(made)) == len(calls)
    placed = {(plan.rank, ins.segment) for plan in report.program.ranks for ins in plan.instructions
              if ins.phase is not None and ins.phase.value == "F"}
    assert sum(what == "F" for _, _, what in made) == len(placed)
    assert {what for _, _, what in made} <= {"F", "B", "BI", "BW"}
    assert set(calls) == {"aot_eager"}


def test_recomputed_and_split_backwards_draw_eagers_masks():
    base = build_schedule("zb1p", 2, 4)
    report = run_check(_workload(1, regions=2), Strategy([*base.directives, Recompute({"PP": "*"})]),
                       optimizer=ADAMW, options=RunOptions.build(compile="aot_eager", runtime="local"))
    assert report.ok, report.failures()


def test_bf16_and_zero2_compiled():
    rtol, atol = TOLERANCES["bf16"]
    report = run_check(_workload(2, regions=2), build_schedule("1f1b", 2, 4), optimizer=ADAMW, precision="bf16",
                       rtol=rtol, atol=atol, options=RunOptions.build(compile="aot_eager", runtime="local"))
    assert report.ok, report.failures()
    report = run_check(_workload(3, regions=2), build_schedule("1f1b", 1, 4, stages=2, dp=2, zero=2), optimizer=ADAMW,
                       options=RunOptions.build(compile="aot_eager", runtime="local", grad_fusion_min_bytes=0))
    assert report.ok, report.failures()


def test_inductor_runs_zero_bubbles_split_backward(monkeypatch):
    """Inductor's own kernels (C++ on this CPU), dropout through aten's generators: within
    fp32 tolerance of eager single-device training (not bit for bit: fused kernels round
    differently)."""
    calls = _counted(monkeypatch)
    report = run_check(_workload(4, regions=2), build_schedule("zb1p", 2, 4), optimizer=ADAMW, steps=2,
                       options=RunOptions.build(compile="inductor", runtime="local"))
    assert report.ok, report.failures()
    assert calls.count("inductor") == 8  # F, BI, BW of two stages; F, B of the loss


def test_compile_option_is_checked():
    with pytest.raises(ValueError, match="compile must be one of inductor, aot_eager"):
        RunOptions.build(compile="tvm")


def test_collectives_inside_a_segment_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["check", "--model", "mlp", "--tp", "2", "--compile"])
    assert exit_.value.code == 2
    assert "--compile cannot trace the collectives inside a segment's forward (--tp 2)" in capsys.readouterr().err
    spec = build_model("mlp", stages=2)
    with pytest.raises(ExecutionError, match="segment s1 runs collectives inside its forward"):
        with Trainer.with_schedule(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn,
                                   schedule="1f1b", pp=2, microbatches=4, tp=2, runtime="local",
                                   compile="aot_eager") as trainer:
            trainer.step(*spec.batches(0))


def test_the_compile_seconds_reach_the_metrics_the_progress_line_and_the_json(tmp_path, capsys):
    """The first step compiles (its seconds in the step's metrics and the progress line); the
    next ones reuse the compiled functions (none); ``--json`` sums them."""
    import json

    from piper_train.metrics import StepMetrics, step_line

    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--model", "mlp", "--pp", "2", "--microbatches", "2", "--steps", "3", "--runtime",
                 "local", "--compile", "aot_eager", "--json", "--metrics", str(metrics)]) == 0
    document = json.loads(capsys.readouterr().out)
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "step"]
    assert [s["torch_compile_seconds"] > 0 for s in steps] == [True, False, False]
    assert document["torch_compile_seconds"] == pytest.approx(steps[0]["torch_compile_seconds"])
    fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in steps[0].items() if k in attrs.fields_dict(StepMetrics)}
    assert "(compiling" in step_line(StepMetrics(**fields))
