"""Strategies on the CUDA backend against single-device training, through ``piper check
--backend cuda`` in a process of its own (the test session's shared Ray cluster has no GPU).
Skipped cleanly without a GPU and cupy; benchmarks/gpu_check.sh runs more strategies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from piper_runtime.backends import cuda_missing

ROOT = Path(__file__).resolve().parents[1]
MISSING = cuda_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"needs a GPU and cupy: {MISSING}")


def _ranks_per_gpu(ranks: int) -> str:
    return str(max(1, -(-ranks // max(1, torch.cuda.device_count()))))


@pytest.mark.parametrize(
    "args, ranks",
    [
        (["--model", "mlp", "--schedule", "1f1b", "--pp", "2"], 2),
        (["--model", "mlp", "--schedule", "1f1b", "--pp", "2", "--dp", "2", "--zero", "3"], 4),
    ],
)
def test_check_on_the_cuda_backend(args: list[str], ranks: int) -> None:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run(
        [sys.executable, "-m", "piper_train.cli", "check", *args, "--steps", "2", "--backend", "cuda",
         "--ranks-per-gpu", _ranks_per_gpu(ranks), "--rtol", "1e-4", "--atol", "1e-5", "--json"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert json.loads(done.stdout)["ok"]
    assert "backend 'cuda' (asked for)" in done.stderr


def _train(args: list[str]) -> dict:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run(
        [sys.executable, "-m", "piper_train.cli", "train", "--model", "mlp", "--schedule", "1f1b", "--pp", "2",
         "--microbatches", "2", "--optimizer", "adamw", "--backend", "cuda", "--ranks-per-gpu", _ranks_per_gpu(2),
         "--json", "--no-progress-bar", *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return json.loads(done.stdout)


def test_fused_adamw_resumes_from_a_checkpoint_on_the_gpu(tmp_path: Path) -> None:
    """The default AdamW is torch's fused kernel, which keeps its step count on the GPU: a
    resumed run must put it back there and train on as the uninterrupted run does."""
    saving = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    first = _train([*saving, "--steps", "3"])
    second = _train([*saving, "--steps", "5", "--resume"])
    whole = _train(["--steps", "5"])
    assert first["losses"] + second["losses"] == whole["losses"]
