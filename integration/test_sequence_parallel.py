"""Sequence parallelism (issue 37, item 4): ``tensor_parallel(..., sp=True)`` / ``--tp 2 --sp``.
The norms, residual adds and dropout between the tensor-parallel regions run on sequence
shards (rows reduce-scatter, columns all-gather, piper_directives.shard_sequence).

The oracle is ``run_check`` (``piper check``) against one device, 2 AdamW steps: examples/llama
(4 query heads, 2 kv heads, SwiGLU, tied embedding/head cut by vocabulary) in float64 at pp=1,
pp=2 under 1F1B and DualPipeV, and DP2 x ZeRO-1, in float32 at pp=1; multi-query attention (1 kv
head, fewer than the 2 ranks) and 4 kv heads for 8 query heads (more); GPT-2 with dropout 0.1 on the embeddings, residual branches and attention weights
(every rank draws one device's mask and keeps its slice); the command line, and its refusal of
``--sp`` without ``--tp``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from piper_directives import build_schedule, parallelize
from piper_runtime import OptimizerSpec
from piper_train.check import TOLERANCES, run_check
from piper_train.workload import load_workload

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = f"{ROOT / 'examples' / 'llama' / 'model.py'}:tiny"
VARIANTS = ROOT / "integration" / "fixtures" / "llama_variants.py"
MODELS = ROOT / "integration" / "fixtures" / "sp_models.py"
pytestmark = pytest.mark.usefixtures("ray_cluster")


def _check(runtime: str, spec: str, *, stages: int, pp: int = 1, schedule: str = "1f1b", microbatches: int = 2,
           dp: int = 1, zero: int = 0, precision: str = "fp64") -> float:
    """``piper check`` of ``spec`` under ``--tp 2 --sp``; the largest relative difference."""
    workload = load_workload(spec, stages=stages)
    strategy = parallelize(build_schedule(schedule, pp, microbatches, stages=stages), dp=dp, zero=zero, tp=2, sp=True)
    rtol, atol = TOLERANCES[precision]
    report = run_check(workload, strategy, steps=2, optimizer=OptimizerSpec("adamw", 1e-3), rtol=rtol, atol=atol,
                       precision=precision, runtime=runtime)
    assert report.ok, report.failures()
    assert all(sh.sequence_parallel for sh in report.program.sharding)
    worst = max(report.worst(w).rel for w in ("grad", "param"))
    print(f"{spec} pp={pp} {schedule} dp={dp} zero={zero} tp=2 sp {precision}: largest relative difference {worst:.3e}")
    return worst


def test_llama_pp2_1f1b(runtime):
    assert _check(runtime, EXAMPLE, stages=4, pp=2) < 1e-12


def test_llama_pp2_dualpipev(runtime):
    assert _check(runtime, EXAMPLE, stages=4, pp=2, schedule="dualpipev", microbatches=4) < 1e-12


def test_llama_dp2_zero1(runtime):
    assert _check(runtime, EXAMPLE, stages=4, dp=2, zero=1) < 1e-12


def test_llama_fp32(runtime):
    _check(runtime, EXAMPLE, stages=4, precision="fp32")


def test_multi_query_attention_fewer_kv_heads_than_ranks(runtime):
    assert _check(runtime, f"{VARIANTS}:mqa", stages=2) < 1e-12


def test_more_kv_heads_than_ranks(runtime):
    assert _check(runtime, f"{MODELS}:gqa4", stages=2) < 1e-12


def test_gpt2_dropout_draws_one_devices_masks(runtime):
    assert _check(runtime, f"{MODELS}:gpt2_dropout", stages=4) < 1e-11


def test_the_command_line(piper):
    done = piper("check", "--model", EXAMPLE, "--pp", "1", "--stages", "4", "--tp", "2", "--sp", "--microbatches", "2",
                 "--steps", "2", "--precision", "fp64", "--runtime", "local", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True


def test_sp_without_tp_is_a_usage_error(piper):
    done = piper("check", "--model", EXAMPLE, "--sp", "--runtime", "local")
    assert done.returncode == 2
    assert "--sp" in done.stderr and "--tp" in done.stderr
