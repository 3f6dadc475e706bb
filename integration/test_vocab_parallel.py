"""Vocabulary parallelism under tensor parallelism (issue 37, item 3): the token embedding cut by
vocabulary rows, the output head by vocabulary columns, the loss a parallel cross-entropy over
the logits' slices (no rank holds the full logits), a tied embedding/head kept one parameter
whose pieces the ranks at one position share.

The oracle is ``run_check`` (``piper check``) in float64 against one device, 2 AdamW steps:
examples/llama (tied head) under TP=2 at PP=1, PP=2 with 1F1B and DualPipeV, DP=2 x ZeRO-1 x
TP=2, a Hugging Face Llama, and plans that name the vocabulary styles; refusals name the
module, the model's line and the rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piper_directives import annotate, build_schedule, capture, parallelize, shard_modules, tensor_parallel
from piper_memory import estimate_memory, plan_memory
from piper_runtime import OptimizerSpec, RunOptions, Runtime
from piper_scheduler import compile_program
from piper_train.check import TOLERANCES, run_check
from piper_train.models import ModelSpec
from piper_train.workload import load_workload

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = f"{ROOT / 'examples' / 'llama' / 'model.py'}:tiny"
pytestmark = pytest.mark.usefixtures("ray_cluster")
VOCAB = {"tok_embeddings.weight", "output.weight"}


def _check(runtime: str, strategy, spec: str | ModelSpec = EXAMPLE, stages: int = 4) -> dict[str, set[str]]:
    """``piper check --precision fp64``; per segment, the parameters cut."""
    workload = load_workload(spec, stages=stages) if isinstance(spec, str) else spec
    rtol, atol = TOLERANCES["fp64"]
    report = run_check(workload, strategy, steps=2, optimizer=OptimizerSpec("adamw", 1e-3), rtol=rtol, atol=atol,
                       precision="fp64", runtime=runtime)
    assert report.ok, report.failures()
    worst = max(report.worst(w).rel for w in ("grad", "param", "loss"))
    assert worst < 1e-12, worst
    loss = next(s.id for s in report.program.segments if s.role.value == "loss")
    assert {sh.segment: sh.collectives for sh in report.program.sharding}[loss] == 1  # the parallel cross-entropy
    return {sh.segment: {p.name for p in sh.params} for sh in report.program.sharding}


def _cut(by_segment: dict[str, set[str]]) -> set[str]:
    return set().union(*by_segment.values())


def test_llama_tp2_cuts_the_tied_embedding_and_head_by_vocabulary(runtime):
    cut = _check(runtime, tensor_parallel(build_schedule("1f1b", 1, 2, stages=4), 2))
    assert VOCAB <= _cut(cut) and "layers.0.attention.wq.weight" in _cut(cut)


def test_llama_pp2_tp2_1f1b(runtime):
    cut = _check(runtime, tensor_parallel(build_schedule("1f1b", 2, 2, stages=4), 2))
    assert VOCAB <= _cut(cut)


def test_llama_pp2_tp2_dualpipev(runtime):
    cut = _check(runtime, tensor_parallel(build_schedule("dualpipev", 2, 4, stages=4), 2))
    assert VOCAB <= _cut(cut)


def test_llama_dp2_zero1_tp2(runtime):
    cut = _check(runtime, parallelize(build_schedule("1f1b", 1, 2, stages=4), dp=2, zero=1, tp=2))
    assert VOCAB <= _cut(cut)


def test_a_plan_names_the_vocabulary_styles_at_pp2(runtime):
    plan = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise",
            "layers.*.attention.wo": "rowwise", "tok_embeddings": "embedding_vocab", "output": "colwise_vocab"}
    cut = _check(runtime, tensor_parallel(build_schedule("1f1b", 2, 2, stages=4), 2, plan=plan))
    assert VOCAB <= _cut(cut) and not any("feed_forward" in n for n in _cut(cut))


BLOCKS = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise", "layers.*.attention.wv": "colwise",
          "layers.*.attention.wo": "rowwise", "layers.*.feed_forward.w1": "colwise",
          "layers.*.feed_forward.w3": "colwise", "layers.*.feed_forward.w2": "rowwise"}


def _memory(runtime: str, plans: list[dict[str, str]]) -> list[list[tuple[int, int, int]]]:
    """Per plan and rank: (measured parameter bytes, estimated, measured activation bytes) of
    one step, the model captured once."""
    w = load_workload(EXAMPLE, stages=4)
    captured = capture(w.model, w.example_inputs, w.example_targets, w.loss_fn)
    out = []
    for plan in plans:
        strategy = tensor_parallel(build_schedule("1f1b", 1, 2, stages=4), 2, plan=plan)
        graph, modules = shard_modules(strategy.apply(captured.graph), captured.modules)
        program = compile_program(plan_memory(graph))
        run = Runtime(program, modules, OptimizerSpec("adamw", 1e-3), RunOptions.build(runtime=runtime))
        try:
            measured = run.step(*w.batches(0), memory=True).memory
        finally:
            run.shutdown()
        estimate = estimate_memory(program, "adamw")
        out.append([(m.parameters, estimate[m.rank].categories()["parameters"], m.activations) for m in measured])
    return out


def test_the_vocabulary_cut_halves_the_tied_table_on_every_rank_as_estimated(runtime):
    """Measured per-rank parameter bytes equal the estimate with and without the cut, and the
    cut saves half the tied 256 x 32 float32 table (16 KiB) on each rank; the activations (the
    logits sliced) drop too."""
    whole, cut = _memory(runtime, [BLOCKS, {**BLOCKS, "tok_embeddings": "embedding_vocab", "output": "colwise_vocab"}])
    for (p0, e0, a0), (p1, e1, a1) in zip(whole, cut, strict=True):
        assert p0 == e0 and p1 == e1
        assert p0 - p1 == 256 * 32 * 4 // 2
        assert a1 < a0


class _OneRegion(nn.Module):
    """Embedding, an MLP pair and a tied head in one region: one tensor under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with annotate("PP"):
            h = self.emb(ids)
            return self.head(h + self.fc2(torch.relu(self.fc1(h))))


def test_a_tied_pair_in_one_region_is_cut_once(runtime):
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    targets = (ids * 3) % 16

    def loss_fn(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), t.flatten())

    workload = ModelSpec("one-region", _OneRegion(), (ids,), (targets,), loss_fn, lambda step: ((ids,), (targets,)), 1, 0)
    cut = _check(runtime, tensor_parallel(build_schedule("1f1b", 1, 2, stages=1), 2), workload, stages=1)
    assert "emb.weight" in _cut(cut)  # the one tensor, under the name the region lists it by
