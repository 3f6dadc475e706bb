"""Weight gradients summed inside the matrix product (``piper_runtime.rank.accumulation``) on the
Ray runtime, against single-device training.

The built-in test models' weights are far below the runtime's 1 MiB threshold, so these
runs set ``grad_fusion_min_bytes=0``: every eligible ``nn.Linear`` fuses. The cases cover
what the fusion meets:

- attention and MLP Linears (one without a bias), tensor-parallel Linears;
- parameters that are views of a bucket's flat buffer (ZeRO-1);
- gradients sharded by hooks (ZeRO-2: left to autograd);
- a schedule whose segments split some backwards (DualPipeV: left to autograd, every
  segment runs a ``BI``/``BW`` pair somewhere);
- bf16 (stage segments compute on cast copies: nothing fused);
- recomputation (the forward runs again, with autograd, inside each ``B``);
- a fused head tied to an embedding, the holders on two ranks and on one.

The oracle is ``run_check`` over 3 AdamW steps, in fp64 at rtol 1e-9 / atol 1e-12 (bf16:
its own tolerances); the run's log says how many layers each rank fused.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piper_directives import Recompute, Strategy, annotate, build_schedule
from piper_ir import Instruction, NodeKind, Phase
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import ModelSpec, build_model
from piper_train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("ray_cluster")
ADAMW = OptimizerSpec("adamw", 1e-3)

CASES = [
    # model, schedule, parallel, precision, microbatches
    ("transformer", "1f1b", {}, None, 4),
    ("mlp", "1f1b", {"dp": 2, "zero": 1}, None, 4),
    ("mlp", "1f1b", {"dp": 2, "zero": 2}, None, 4),
    ("mlp", "dualpipev", {}, None, 4),
    ("transformer", "1f1b", {"tp": 2}, None, 2),
    ("mlp", "1f1b", {}, "bf16", 4),
    ("transformer", "1f1b+recompute", {}, None, 4),
]


@pytest.mark.parametrize(
    ("model", "schedule", "parallel", "precision", "microbatches"), CASES,
    ids=[f"{m}-{s}-{p}-{q}" for m, s, p, q, _ in CASES],
)
def test_fused_gradients_match_single_device(model, schedule, parallel, precision, microbatches):
    stages = 4 if schedule == "dualpipev" else 2
    dtype = torch.float32 if precision else torch.float64
    workload = build_model(model, stages=stages, seed=3, dtype=dtype)
    strategy = build_schedule(schedule.removesuffix("+recompute"), 2, microbatches, stages=stages, **parallel)
    if schedule.endswith("+recompute"):  # the forward again, with autograd, inside each B
        strategy = Strategy([*strategy.directives, Recompute({"PP": "*"})])
    lines: list[str] = []
    tolerances = {} if precision else {"rtol": 1e-9, "atol": 1e-12}
    report = run_check(workload, strategy, optimizer=ADAMW, precision=precision, log=lines.append,
                       grad_fusion_min_bytes=0, **tolerances)
    assert report.ok, report.failures()
    fused = [line for line in lines if line.startswith("gradients: ")]
    if parallel.get("zero") == 2 or schedule == "dualpipev" or precision:  # nothing the fusion may take
        assert not fused
        return
    (line,) = fused
    assert line.endswith("(input_grads_first)")
    per_rank = {int(r): int(n) for r, n in re.findall(r"rank (\d+): (\d+)", line)}
    assert per_rank and all(n > 0 for n in per_rank.values())


class _TiedHead(nn.Module):
    """Two regions: an embedding and a projection, then a head whose weight is the embedding's."""

    def __init__(self, vocab: int = 11, d: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with annotate("PP"):
            x = torch.tanh(self.embed(tokens))
        with annotate("PP"):
            return self.head(torch.tanh(self.proj(x)))


def _token_batches(step: int) -> tuple[tuple[torch.Tensor], tuple[torch.Tensor]]:
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(step))
    return (tokens,), ((tokens * 3 + 1) % 11,)


@pytest.mark.parametrize("pp", [2, 1], ids=["holders-apart", "holders-on-one-rank"])
def test_a_fused_head_tied_to_an_embedding(pp):
    torch.manual_seed(0)
    model = _TiedHead().double()
    (x,), (y,) = _token_batches(0)

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    workload = ModelSpec("tied-head", model, (x,), (y,), loss, _token_batches, 2, 0)
    lines: list[str] = []
    report = run_check(workload, build_schedule("1f1b", pp, 4, stages=2), optimizer=ADAMW, log=lines.append,
                       grad_fusion_min_bytes=0, rtol=1e-9, atol=1e-12)
    assert report.ok, report.failures()
    program = report.program
    assert [t.name for t in program.ties] == ["embed.weight"]
    assert len({r for seg in ("s0", "s1") for r in program.devices_of(seg)}) == pp
    assert any(line.startswith("gradients: ") for line in lines)


def _profiled_steps(workload: ModelSpec, strategy: Strategy, first: bool, steps: int = 2, compile: str | None = None):
    with Trainer(
        workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn, strategy,
        optimizer=ADAMW, grad_fusion_min_bytes=0, input_grads_first=first, compile=compile,
    ) as trainer:
        results = [trainer.runtime.step(*workload.batches(s), keep_grads=True, profile=True) for s in range(steps)]
        return results, trainer.program


@pytest.mark.parametrize(("schedule", "compile"), [("1f1b", None), ("interleaved_1f1b", None), ("1f1b", "aot_eager")])
def test_the_last_input_gradients_go_before_the_weight_products(schedule, compile):
    """``piper_runtime.rank.input_grads_first``: with it, the last backward of each stage that
    sends a gradient is timed around its send (the weight products come after it; compiled,
    the segment's ``BW``); without, every send starts after its backward ends. Losses and
    gradients are bit for bit the same."""
    stages = 4 if schedule == "interleaved_1f1b" else 2
    workload = build_model("mlp", stages=stages, seed=3)
    strategy = build_schedule(schedule, 2, 4, stages=stages)
    (on, program), (off, _) = (_profiled_steps(workload, strategy, first, compile=compile) for first in (True, False))
    for a, b in zip(on, off, strict=True):
        assert a.losses == b.losses
        assert a.grads.keys() == b.grads.keys() and all(torch.equal(a.grads[n], b.grads[n]) for n in a.grads)

    def around_sends(result) -> dict[tuple[int, str, int], bool]:
        """(rank, stage, microbatch) of each gradient send -> whether the backwards right
        before it on its rank (a loss's and its stage's, or a stage's), and so the weight
        products, ended after the send was posted."""
        spans = {(t.rank, t.instruction): (t.start, t.end) for t in result.timings}
        found = {}
        for plan in program.ranks:
            passes: list[Instruction] = []
            for ins in plan.instructions:
                if ins.kind is NodeKind.COMPUTE and ins.phase is Phase.B:
                    passes.append(ins)
                    continue
                if ins.kind is NodeKind.SEND and ins.value.startswith("grad:") and passes:
                    end = max(spans[(plan.rank, b.id)][1] for b in passes)
                    found[(plan.rank, passes[-1].segment, ins.microbatch)] = end > spans[(plan.rank, ins.id)][0]
                passes = []
        return found

    sends = around_sends(on[-1])
    assert len(sends) == (stages - 1) * 4  # every non-first stage sends each microbatch's gradient
    last = {(rank, seg): max(mb for r, s, mb in sends if (r, s) == (rank, seg)) for rank, seg, _ in sends}
    assert sends == {(r, s, mb): last[(r, s)] == mb for r, s, mb in sends}
    assert not any(around_sends(off[-1]).values())
