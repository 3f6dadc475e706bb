"""``--tp``/``--ep`` on models whose embedding or head sits in a region of its own (item 7 of
issue 10): only regions that hold a column/row-parallel Linear pair (tp) or call an expert
module (ep) are sharded; the others run whole on every rank of their group (replicated over
it), and the whole still matches single-device training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from piper_directives import annotate, build_schedule
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import ModelSpec
from piper_train.workload import load_workload

MOE = Path(__file__).resolve().parent / "fixtures" / "moe_regions.py"
SGD = OptimizerSpec("sgd", 0.05)  # AdamW would amplify the rounding noise of tiny expert gradients


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_expert_parallelism_shards_only_the_expert_regions(schedule):
    workload = load_workload(f"{MOE}:factory", stages=4)
    report = run_check(workload, build_schedule(schedule, 2, 4, stages=4, ep=2), optimizer=SGD, steps=2)
    assert report.ok, report.failures()
    sharded = {sh.segment: sh for sh in report.program.sharding}
    assert [s for s, sh in sharded.items() if sh.collectives] == ["s1", "s2"]  # the MoE blocks
    assert not sharded["s0"].params and not sharded["s3"].params  # embedding and head stay whole


def test_expert_parallelism_nested_in_data_parallelism_from_the_command_line(piper):
    done = piper("check", "--model", f"{MOE}:factory", "--pp", "2", "--ep", "2", "--dp", "2", "--zero", "1",
                 "--steps", "2", "--optimizer", "sgd", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["ok"]
    assert "pp=2, dp=2, tp=1, ep=2, zero=1" in done.stderr


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class EmbedMlpHead(nn.Module):
    """Embedding | MLP | MLP | head: only the MLPs hold Linear pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(Mlp() for _ in range(2))
        self.drop = nn.Dropout(0.1)  # on whole activations: every rank draws one device's mask
        self.head = nn.Linear(16, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with annotate("PP"):
            x = self.embed(tokens)
        for block in self.blocks:
            with annotate("PP"):
                x = self.drop(block(x))
        with annotate("PP"):
            return self.head(x)


@pytest.mark.usefixtures("ray_cluster")
def test_tensor_parallelism_cuts_the_embedding_and_head_regions_by_vocabulary():
    """The regions without a Linear pair (the embedding's, the head's) are cut by vocabulary
    (``shard_vocab``): one all-reduce in the lookup, the head's logits sliced, the loss a
    parallel cross-entropy (issue 37, item 3)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 20, (8,), generator=torch.Generator().manual_seed(1))
    workload = ModelSpec("embed-mlp-head", EmbedMlpHead(), (tokens,), ((tokens * 3) % 20,),
                         nn.functional.cross_entropy, lambda step: ((tokens,), ((tokens * 3) % 20,)), 4, 0)
    report = run_check(workload, build_schedule("1f1b", 2, 4, stages=4, tp=2), optimizer=SGD, steps=2)
    assert report.ok, report.failures()
    collectives = {sh.segment: sh.collectives for sh in report.program.sharding}
    assert collectives == {"s0": 1, "s1": 1, "s2": 1, "s3": 1, "loss": 1}
