"""Tied parameters (item 2 of issue 10): one logical parameter held by several regions, its
gradient summed over the holders once per step, the copies never drifting, under every
schedule and with data parallelism at every ZeRO level; matched against single-device
training (``run_check`` also checks, through ``Runtime.parameters``, that every copy it gets
back is bitwise equal to the others).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piper_directives import annotate, build_schedule, capture
from piper_ir import MemoryPlanError, NodeKind
from piper_memory import plan_memory
from piper_runtime import OptimizerSpec
from piper_scheduler import compile_program
from piper_train.check import run_check
from piper_train.models import ModelSpec
from piper_train.workload import load_factory

VOCAB, D = 16, 8


class TiedLM(nn.Module):
    """Four regions: the embedding, two hidden layers (one with dropout), the head, whose
    weight *is* the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.hidden = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.drop = nn.Dropout(0.2)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with annotate("PP"):
            x = torch.tanh(self.wte(tokens))
        with annotate("PP"):
            x = self.drop(torch.tanh(self.hidden[0](x)))
        with annotate("PP"):
            x = torch.tanh(self.hidden[1](x))
        with annotate("PP"):
            return self.lm_head(x)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(step: int) -> tuple[tuple[torch.Tensor], tuple[torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (8, 5), generator=torch.Generator().manual_seed(step))
    return (tokens,), ((tokens + 1) % VOCAB,)


def _workload() -> ModelSpec:
    torch.manual_seed(0)
    (x,), (y,) = _batches(0)
    return ModelSpec("tied", TiedLM(), (x,), (y,), _loss, _batches, 4, 0)


ADAMW = OptimizerSpec("adamw", 1e-2)

CASES = [
    # 1F1B, GPipe-like interleaving, a split backward (BI/BW), mirrored replicas, both holders on a rank
    ("1f1b", {}), ("interleaved_1f1b", {}), ("zb1p", {}), ("dualpipe", {}), ("dualpipev", {}),
    ("1f1b", {"dp": 2, "zero": 0}), ("1f1b", {"dp": 2, "zero": 1}), ("1f1b", {"dp": 2, "zero": 2}),
    ("1f1b", {"dp": 2, "zero": 3}), ("dualpipev", {"dp": 2, "zero": 1}), ("dualpipev", {"dp": 2, "zero": 3}),
    ("dualpipe", {"dp": 2, "zero": 1}),
]


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize(("schedule", "parallel"), CASES, ids=[f"{s}-{p}" for s, p in CASES])
def test_a_tied_weight_trains_as_one_parameter(schedule, parallel):
    strategy = build_schedule(schedule, 2, 4, stages=4, **parallel)
    report = run_check(_workload(), strategy, optimizer=ADAMW, steps=3)
    assert report.ok, report.failures()
    program = report.program
    assert [t.name for t in program.ties] == ["wte.weight"]
    held = {r for seg in ("s0", "s3") for r in program.devices_of(seg)}
    summed = {r for c in program.communicators if c.traffic == "tie" for r in c.ranks}
    assert summed <= held
    if program.devices_of("s0") != program.devices_of("s3"):  # holders apart: summed across them
        assert summed


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize(("schedule", "parallel"), [("1f1b", {}), ("1f1b", {"dp": 2, "zero": 3}), ("dualpipev", {})],
                         ids=["1f1b", "1f1b-dp2-zero3", "dualpipev"])
def test_clipping_counts_a_tied_parameter_once_and_evaluation_draws_no_masks(schedule, parallel):
    """The global gradient norm counts the tied gradient once (in its first holder), though
    every holder's rank holds the summed copy, so clipping scales as on one device; a held-out
    loss runs the modules in eval mode (dropout off) on both sides."""
    workload = attrs.evolve(_workload(), eval_batches=lambda k: _batches(100 + k))
    report = run_check(workload, build_schedule(schedule, 2, 4, stages=4, **parallel), optimizer=ADAMW, steps=2,
                       clip_grad_norm=0.05, eval_batches=1)
    assert report.ok, report.failures()
    assert report.grad_norms and all(n > 0.05 for n in report.grad_norms)  # the clipping bites
    assert [d for d in report.differences if d.what == "eval"]


def _planned(schedule: str, **parallel: int):
    torch.manual_seed(0)
    model = TiedLM()
    (x,), (y,) = _batches(0)
    graph = capture(model, (x,), (y,), _loss).graph
    return compile_program(plan_memory(build_schedule(schedule, 2, 4, stages=4, **parallel).apply(graph)))


def test_the_plan_sums_a_tie_over_its_holders_once_per_step():
    """1F1B on two ranks: the embedding (s0, rank 0) and the head (s3, rank 1) hold the tie;
    one all-reduce on a communicator of its own sums their gradients, after every backward of
    either holder and before either optimizer step."""
    program = _planned("1f1b")
    (comm,) = [c for c in program.communicators if c.traffic == "tie"]
    assert (comm.id, comm.ranks) == ("tie:0-1", (0, 1))
    for rank, seg in ((0, "s0"), (1, "s3")):
        plan = program.plan(rank).instructions
        sums = [i for i, ins in enumerate(plan) if ins.communicator == comm.id]
        assert len(sums) == 1 and plan[sums[0]].kind is NodeKind.ALL_REDUCE
        backward = [i for i, ins in enumerate(plan) if ins.segment == seg and ins.phase and ins.phase.value == "B"]
        step = next(i for i, ins in enumerate(plan) if ins.kind is NodeKind.OPTIMIZER and ins.segment == seg)
        assert max(backward) < sums[0] < step


def test_holders_on_one_rank_share_one_tensor_and_need_no_sum():
    """DualPipeV puts the first and the last region on rank 0: no bucket, no communicator;
    rank 0's optimizer of s0 steps the shared tensor after s3's passes too."""
    program = _planned("dualpipev")
    assert not [c for c in program.communicators if c.traffic == "tie"]
    assert not [b for b in program.buckets if "tie" in b.id]


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("pp", [1, 2])
def test_tensor_parallel_holders_train_the_tie_as_one_parameter(pp):
    """``--tp 2`` on a GPT whose head is tied to its embedding: every rank of a
    tensor-parallel group computes the whole gradient of a parameter it does not cut, so the
    tie's copies are replicas only across the groups' positions. At pp=1 both holders share
    each rank's tensor and nothing is summed (compile used to refuse it, asking for a bucket
    on both ranks); at pp=2 each position sums its two holders. SGD: Adam would amplify the
    rounding of the row-parallel sums (README)."""
    workload = load_factory(f"{Path(__file__).parent / 'fixtures' / 'user_model.py'}:gpt")
    report = run_check(workload, build_schedule("1f1b", pp, 4, stages=2, tp=2), optimizer=OptimizerSpec("sgd", 0.1),
                       steps=3)
    assert report.ok, report.failures()
    ties = [c for c in report.program.communicators if c.traffic == "tie"]
    assert sorted(c.ranks for c in ties) == ([] if pp == 1 else [(0, 2), (1, 3)])


def test_unsupported_combinations_are_refused_naming_both_module_paths():
    with pytest.raises(MemoryPlanError) as err:
        _planned("dualpipe", dp=2, zero=2)
    text = str(err.value)
    assert "parameter 'wte.weight' is tied" in text and "DualPipe with ZeRO-2/3" in text
    assert "'wte.weight' in s0" in text and "'lm_head.weight' in s3" in text
    assert "module 'wte'" in text and "module 'lm_head'" in text and "test_ties.py" in text
