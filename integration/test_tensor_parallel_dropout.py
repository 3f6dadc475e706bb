"""Dropout inside tensor-parallel regions (piper_directives.shard_dropout): on the attention
weights (``scaled_dot_product_attention``'s ``dropout_p``, or an ``nn.Dropout`` on nanoGPT's
written-out attention) and on an MLP's hidden units, every rank draws the whole activation's
mask from the region's generator state, as one device does, and keeps its heads or units.

The oracle is ``run_check`` against one device, float64, 2 AdamW steps, on examples/gpt2 as
shipped and integration/fixtures/dropout_models.py; a draw no rank can reproduce (noise from
``rand_like`` on cut hidden units) is refused by name. Drawing per rank instead misses one
device's losses and gradients by about 0.57 relative (measured, ``manual`` at pp=1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from piper_directives import build_schedule, parallelize
from piper_ir import DirectiveError
from piper_runtime import OptimizerSpec
from piper_train.check import TOLERANCES, run_check
from piper_train.workload import load_workload

MODELS = Path(__file__).resolve().parent / "fixtures" / "dropout_models.py"
pytestmark = pytest.mark.usefixtures("ray_cluster")


def _check(runtime: str, name: str, *, pp: int = 1, sp: bool = False) -> float:
    workload = load_workload(f"{MODELS}:{name}", stages=4)
    rtol, atol = TOLERANCES["fp64"]
    report = run_check(workload, parallelize(build_schedule("1f1b", pp, 2, stages=4), tp=2, sp=sp), steps=2,
                       optimizer=OptimizerSpec("adamw", 1e-3), rtol=rtol, atol=atol, precision="fp64",
                       runtime=runtime)
    assert report.ok, report.failures()
    assert {p.name for sh in report.program.sharding for p in sh.params} >= {
        "transformer.h.1.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight"}
    return max(report.worst(w).rel for w in ("loss", "grad", "param"))


@pytest.mark.parametrize("pp", [1, 2])
def test_gpt2_as_shipped_attention_dropout_inside_the_cut_heads(runtime, pp):
    assert _check(runtime, "gpt2", pp=pp) < 1e-11


def test_nanogpt_attention_and_hidden_unit_dropout(runtime):
    assert _check(runtime, "manual") < 1e-11


def test_with_sequence_parallelism(runtime):
    assert _check(runtime, "manual", sp=True) < 1e-11


def test_noise_no_rank_can_draw_is_refused_by_name(runtime):
    with pytest.raises(DirectiveError, match=r"rand_like.*dropout_models.py.*line \d+.*column-parallel "
                                             r"transformer.h.0.mlp.c_fc and row-parallel transformer.h.0.mlp.c_proj"):
        _check(runtime, "sampling")
