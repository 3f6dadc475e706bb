"""Weight gradients summed inside the matrix product (``piper_runtime.accumulation``) on the
Ray runtime, against single-device training.

The built-in test models' weights are far below the runtime's 1 MiB threshold, so these runs set
``grad_fusion_min_bytes=0``: every eligible ``nn.Linear`` fuses. The cases cover what the
fusion meets: attention and MLP Linears (one without a bias), parameters that are views of a
bucket's flat buffer (ZeRO-1), gradients sharded by hooks (ZeRO-2: left to autograd), a
schedule whose segments split some backwards (DualPipeV: left to autograd, every segment
runs a ``BI``/``BW`` pair somewhere), tensor-parallel Linears, and
bf16 (stage segments compute on cast copies: nothing fused). The oracle is
``run_check`` over 3 AdamW steps, in fp64 at rtol 1e-9 / atol 1e-12 (bf16: its own
tolerances); the run's log says how many layers each rank fused.
"""

from __future__ import annotations

import re

import pytest
import torch

from piper_directives import build_schedule
from piper_runtime import OptimizerSpec
from piper_train.check import run_check
from piper_train.models import build_model

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
]


@pytest.mark.parametrize(
    ("model", "schedule", "parallel", "precision", "microbatches"), CASES,
    ids=[f"{m}-{s}-{p}-{q}" for m, s, p, q, _ in CASES],
)
def test_fused_gradients_match_single_device(model, schedule, parallel, precision, microbatches):
    stages = 4 if schedule == "dualpipev" else 2
    dtype = torch.float32 if precision else torch.float64
    workload = build_model(model, stages=stages, seed=3, dtype=dtype)
    strategy = build_schedule(schedule, 2, microbatches, stages=stages, **parallel)
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
    per_rank = {int(r): int(n) for r, n in re.findall(r"rank (\d+): (\d+)", line)}
    assert per_rank and all(n > 0 for n in per_rank.values())
