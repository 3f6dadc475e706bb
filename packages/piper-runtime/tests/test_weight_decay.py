"""Weight decay by parameter group (``OptimizerSpec``): matrices decay, biases and norms do
not; a ZeRO shard that mixes both is stepped as pieces, each with its group's decay, so every
element moves exactly as on one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from piper_ir import Bucket, Residency
from piper_runtime import OptimizerSpec
from piper_runtime.rank.buckets import BucketState
from piper_runtime.rank.optimizers import _decay_runs


def test_groups_decay_matrices_only() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Embedding(5, 4))
    spec = OptimizerSpec("adamw", 1e-2, weight_decay=0.1, no_decay=("2.*",))
    opt = spec.build_named(model.named_parameters())
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert [p.shape for p in decayed["params"]] == [(4, 3)]  # the embedding matches no_decay
    assert len(plain["params"]) == 4  # Linear bias, LayerNorm weight and bias, the embedding
    legacy = OptimizerSpec("adamw", 1e-2).build(model.parameters())  # torch's way: one group
    assert len(legacy.param_groups) == 1 and legacy.param_groups[0]["weight_decay"] == 0.01
    assert OptimizerSpec("adamw").default_weight_decay == 0.01 and OptimizerSpec("sgd").default_weight_decay == 0
    with pytest.raises(ValueError, match="given twice"):
        OptimizerSpec("adamw", weight_decay=0.1, kwargs={"weight_decay": 0.1})


def _bucket_state(replica: int, shards: int) -> BucketState:
    w, b, ln = nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(2)), nn.Parameter(torch.randn(3, 1))
    bucket = Bucket(
        "bucket:s0:0", "s0", ("l.weight", "l.bias", "m.weight"), 11, shards,
        optimizer_home=Residency.SHARDED,
    )
    return BucketState(bucket, [w, b, ln], replica)


@pytest.mark.parametrize(
    ("replica", "runs"),
    [
        (0, [(0, 4, True)]),  # elements 0-3: the weight only
        (1, [(0, 2, True), (2, 4, False)]),  # 4-5 weight, 6-7 bias
        (2, [(0, 4, True)]),  # 8-10 the (3, 1) weight; 11, padding, joins it
    ],
)
def test_a_shard_is_cut_into_runs_of_one_decay_group(replica: int, runs: list) -> None:
    spec = OptimizerSpec("adamw", weight_decay=0.1)
    assert _decay_runs(_bucket_state(replica, 3), spec) == runs
