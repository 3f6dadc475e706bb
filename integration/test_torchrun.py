"""The ``torchrun`` runtime: every rank a process ``torchrun`` launched, each running the same
``piper`` command (``piper_runtime.driver.spmd_ranks``), computes exactly what the ``local``
runtime computes. ``piper check`` gives the same document; a run stopped after some steps and
resumed from its checkpoint, and a run one of whose processes is killed (torchrun starts the
job again, which resumes by itself), end with the losses and parameters of an uninterrupted
run, bit for bit. Only rank 0 prints (one ``--json`` document on stdout). A rank that raises
fails every process, each naming it. Each launch is ``torchrun --standalone`` as a process of
its own, on tiny models, with a timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from piper_train.checkpoints import complete_checkpoints, model_state_dict

pytestmark = pytest.mark.own_process
LAUNCH_TIMEOUT_S = 240.0
# Four ranks: two pipeline stages, each replicated twice with ZeRO-1 (sharded optimizer state).
TRAIN = ["train", "--model", "mlp", "--schedule", "1f1b", "--pp", "2", "--dp", "2", "--zero", "1",
         "--microbatches", "2", "--no-bind-cores", "--json"]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def _env() -> dict[str, str]:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    for name in LAUNCH_ENV:  # a test run under a launcher itself: each launch starts afresh
        env.pop(name, None)
    return env


def _torchrun(nproc: int, *args: str, restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={restarts}", "-m", "piper_train", *args, "--runtime", "torchrun"]


def _local(*args: str) -> list[str]:
    return [sys.executable, "-m", "piper_train", *args, "--runtime", "local"]


def _run(command: list[str], cwd: Path) -> tuple[list[dict[str, Any]], str]:
    """The ``--json`` documents a command printed, and its stderr; it must exit 0."""
    done = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-6000:]
    return _documents(done.stdout), done.stderr


def _documents(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def _assert_same_model(got: Path, want: Path) -> None:
    a, b = model_state_dict(got), model_state_dict(want)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def _no_partial(root: Path) -> None:
    assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_check_under_torchrun_gives_the_local_runtimes_document(tmp_path: Path) -> None:
    args = ["check", "--model", "mlp", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4",
            "--clip-grad-norm", "1.0", "--json"]
    spmd, err = _run(_torchrun(2, *args), tmp_path)
    local, _ = _run(_local(*args), tmp_path)
    assert len(spmd) == 1, spmd  # rank 1 prints no document
    assert spmd[0]["ok"] and spmd[0]["exit_code"] == 0
    assert spmd == local  # every loss, gradient, parameter and gradient-norm difference alike
    assert "rank 0 of 2" in err and "rank 1 of 2" not in err  # rank 1 says nothing


def test_a_run_resumed_under_torchrun_ends_as_an_uninterrupted_one(tmp_path: Path) -> None:
    (whole,), _ = _run(_local(*TRAIN, "--steps", "6", "--checkpoint-every", "2", "--checkpoint-dir", "local"),
                       tmp_path)
    common = [*TRAIN, "--checkpoint-every", "2", "--checkpoint-dir", "spmd"]
    (first,), _ = _run(_torchrun(4, *common, "--steps", "4"), tmp_path)
    (second,), _ = _run(_torchrun(4, *common, "--steps", "6", "--resume"), tmp_path)
    assert second["first_step"] == 5
    assert first["losses"] + second["losses"] == whole["losses"]
    assert [s for s, _ in complete_checkpoints(tmp_path / "spmd")] == [2, 4, 6]
    _assert_same_model(tmp_path / "spmd", tmp_path / "local")
    # The ranks' files hold what the local runtime's hold, optimizer state included (not the
    # processes' random generators: the local runtime's ranks share one process's).
    for name in (f"rank-{r:05d}.safetensors" for r in range(4)):
        got, want = (load_file(tmp_path / run / "step-00000006" / name) for run in ("spmd", "local"))
        assert got.keys() == want.keys()
        tensors = [k for k in got if not k.startswith("object/")]
        assert tensors and all(torch.equal(got[k], want[k]) for k in tensors), name
    _no_partial(tmp_path / "spmd")


def test_torchrun_restarts_a_killed_rank_from_the_latest_checkpoint(tmp_path: Path) -> None:
    steps = "100"
    (whole,), _ = _run(_local(*TRAIN, "--steps", steps, "--checkpoint-dir", "local"), tmp_path)
    root = tmp_path / "spmd"
    launch = subprocess.Popen(
        _torchrun(4, *TRAIN, "--steps", steps, "--checkpoint-every", "5", "--checkpoint-dir", "spmd", restarts=1),
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not complete_checkpoints(root):
            assert launch.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
        os.kill(_worker(launch.pid, rank=1), signal.SIGKILL)
        out, err = launch.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
    assert launch.returncode == 0, err[-6000:]
    last = _documents(out)[-1]  # the first attempt's rank 0 may have printed what it did before
    assert last["exit_code"] == 0 and "restart 1" in err
    assert last["first_step"] > 1, last  # resumed from a checkpoint, not from the start
    assert last["losses"] == whole["losses"][last["first_step"] - 1:]
    _assert_same_model(root, tmp_path / "local")
    _no_partial(root)


def test_a_rank_that_raises_fails_every_process_naming_it(tmp_path: Path) -> None:
    script = Path(__file__).parent / "fixtures" / "torchrun_failing_rank.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
               "train", "--model", "mlp", "--pp", "2", "--steps", "50", "--steps-per-call", "1", "--runtime", "torchrun"]
    done = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode != 0
    # Both processes exit 3 and name the rank that raised (not the other process, which ended the run).
    assert done.stderr.count("piper train: run failed: rank 1 failed during step") == 2, done.stderr[-6000:]
    assert "RuntimeError: injected failure" in done.stderr and "exitcode  : 3" in done.stderr


def _worker(agent: int, rank: int) -> int:
    """The process of ``rank`` among the children of torchrun's agent ``agent``."""
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under torchrun's agent {agent}")
