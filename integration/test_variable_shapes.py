"""Batches whose shapes change: sequence lengths cycling 16/24/32 and an epoch's partial last
batch train (a program per shape of a batch's pieces, compiled on first sight and kept) and
match single-device training, under 1F1B pp=2 and under DP2 with ZeRO-1 and ZeRO-3; a padding
mask, a second input, reaches every region that uses it. On the ``local`` runtime."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from piper_directives import annotate, build_schedule
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.loop import fit
from piper_train.models import ModelSpec
from piper_train.reference import ReferenceTrainer
from piper_train.trainer import Trainer

VOCAB, MAX_LEN = 32, 32
LENGTHS = (16, 24, 32)


class Block(nn.Module):
    """Causal self-attention over the positions the padding mask keeps, and an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ff = nn.Linear(d, d)
        self.register_buffer("causal", torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        q, k, v = self.qkv(self.ln(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        keep = ~self.causal.narrow(0, 0, t).narrow(1, 0, t) & mask.unsqueeze(1).unsqueeze(2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        x = x + self.proj((scores.masked_fill(~keep, -1e9).softmax(-1) @ v).transpose(1, 2).flatten(2))
        return x + torch.tanh(self.ff(x))


class MaskedLM(nn.Module):
    """``(tokens (b, t), padding mask (b, t)) -> logits (b, t, vocab)``, one region per block,
    every block reading the mask; any length up to ``MAX_LEN``."""

    def __init__(self, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(MAX_LEN, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, 2) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = tokens
        for i, block in enumerate(self.blocks):
            with annotate("PP"):
                if i == 0:
                    x = self.tok(x) + self.pos.narrow(0, 0, tokens.size(1))
                x = block(x, mask)
                if i == len(self.blocks) - 1:
                    x = self.head(x)
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int, samples: int = 8) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Step ``step``'s batch: length ``LENGTHS[step % 3]``, each sequence padded after a length
    of its own (the mask says where)."""
    t = LENGTHS[step % len(LENGTHS)]
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (samples, t + 1), generator=g)
    lengths = torch.randint(t // 2, t + 1, (samples,), generator=g)
    return (seq[:, :-1], torch.arange(t)[None, :] < lengths[:, None]), (seq[:, 1:],)


STEPS = 6  # lengths 16, 24, 32, 16, 24 and a partial last batch of 5 samples of length 32


def batches(step: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    return batch(step, 5 if step == STEPS - 1 else 8)


def _workload() -> ModelSpec:
    torch.manual_seed(0)
    model = MaskedLM().double()
    inputs, targets = batches(0)
    return ModelSpec("masked-lm", model, inputs, targets, lm_loss, batches, 2, 0, held_out)


def held_out(k: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Held-out batch ``k``: length 24, then a partial batch of 7 of length 32."""
    return batch(101 + k, 8 if k == 0 else 7)


@pytest.mark.parametrize(
    ("schedule", "pp", "microbatches", "dp", "zero"),
    [("1f1b", 2, 4, 1, 0), ("1f1b", 1, 2, 2, 1), ("1f1b", 1, 2, 2, 3)],
    ids=["1f1b-pp2", "dp2-zero1", "dp2-zero3"],
)
def test_lengths_cycling_and_a_partial_last_batch_match_single_device(schedule, pp, microbatches, dp, zero) -> None:
    """Every microbatch loss, every gradient and every parameter of ``STEPS`` steps equal
    single-device training's on the same pieces: the partial batch of 5 is cut 2/1/1/1 (pp=2,
    4 microbatches) or 2,1 | 1,1 (2 microbatches x 2 replicas), each piece's loss weighted by
    its samples, so the step is the batch's mean. Held-out batches of other shapes (a length of
    24, a partial batch of 7) evaluate as one device does too."""
    strategy = build_schedule(schedule, pp, microbatches, stages=2, dp=dp, zero=zero)
    report = run_check(_workload(), strategy, steps=STEPS, optimizer=OptimizerSpec("adamw", 1e-2),
                       rtol=1e-9, atol=1e-12, runtime="local", eval_batches=2)
    assert report.ok, report.failures()
    assert sum(d.what == "loss" for d in report.differences) == STEPS * microbatches
    assert sum(d.what == "eval" for d in report.differences) == 2


def test_a_program_per_shape_is_compiled_once_and_counted_and_a_shape_the_model_cannot_take_is_named() -> None:
    spec = _workload()
    opt = OptimizerSpec("sgd", 0.1)
    strategy = build_schedule("1f1b", 2, 2, stages=2)
    lines: list[str] = []
    with Trainer(spec.model, spec.example_inputs, spec.example_targets, lm_loss, strategy, optimizer=opt,
                 runtime="local", log=lines.append) as trainer:
        reference = ReferenceTrainer(spec.model, lm_loss, opt, 2)
        for step in (0, 1, 0, 1, 1):
            got, want = trainer.step(*batch(step)), reference.step(*batch(step))
            assert got.loss == pytest.approx(want.loss, rel=1e-12)
        assert trainer.plans == 2 and len(trainer.variant_seconds) == 1  # 16 (the example's) and 24
        assert sum("compiled a program for batch pieces of shapes input:0 4x24, input:1 4x24, target:0 4x24" in line
                   for line in lines) == 1
        assert trainer.state.samples == 5 * 8
        too_long = (torch.zeros(8, 40, dtype=torch.long), torch.ones(8, 40, dtype=torch.bool)), (
            torch.zeros(8, 40, dtype=torch.long),)
        with pytest.raises(ValueError, match=r"pieces have shapes input:0 4x40.*capturing the model on such pieces"):
            trainer.step(*too_long)
        assert trainer.state.step == 5 and trainer.plans == 2  # nothing was sent
        got = trainer.step(*batch(2, 3))  # the run goes on: length 32, pieces of 2 and 1
        want = reference.step(*batch(2, 3))
        assert got.losses == pytest.approx(want.losses, rel=1e-12) and got.loss == pytest.approx(want.loss, rel=1e-12)
        assert trainer.plans == 4
        params = trainer.parameters()
        for name, p in reference.parameters().items():
            torch.testing.assert_close(params[name], p, rtol=1e-9, atol=1e-12)


def test_fit_trains_every_batch_of_an_epoch_and_reports_its_programs() -> None:
    """``fit`` over a list of batches of cycling lengths whose last is partial, two epochs:
    every batch trains (none dropped), the metrics say how many programs the run holds, and
    the losses are single-device training's."""
    spec = _workload()
    opt = OptimizerSpec("sgd", 0.1)
    data = [batches(step) for step in range(STEPS)]
    with Trainer(spec.model, spec.example_inputs, spec.example_targets, lm_loss,
                 build_schedule("1f1b", 2, 2, stages=2), optimizer=opt, runtime="local") as trainer:
        result = fit(trainer, data, epochs=2)
    reference = ReferenceTrainer(spec.model, lm_loss, opt, 2)
    want = [reference.step(*b).loss for b in data + data]
    assert [m.loss for m in result.steps] == pytest.approx(want, rel=1e-10)
    assert [m.epoch for m in result.steps] == [0] * STEPS + [1] * STEPS
    assert [m.plans for m in result.steps][:3] == [1, 2, 3] and result.steps[-1].plans == 5  # + 3x32 and 2x32
    assert result.steps[-1].plan_seconds > 0
