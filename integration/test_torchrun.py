"""The ``torchrun`` runtime: every rank a process ``torchrun`` launched, each running the same
``piper`` command (``piper_runtime.driver.spmd_ranks``), computes exactly what the ``local``
runtime computes. ``piper check`` gives the same document; a run one of whose processes is
killed (torchrun starts the job again, which resumes by itself), then resumed from its
checkpoint for more steps, ends with the losses and parameters of an uninterrupted run, bit
for bit (one job, which two tests check: ``restarted_and_resumed``). Only rank 0 prints (one
``--json`` document on stdout). A rank that raises fails every process, each naming it. Each
launch is ``torchrun --standalone`` as a process of its own, on tiny models, with a timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import load_file

from piper_train.checkpoints import complete_checkpoints, model_state_dict

pytestmark = pytest.mark.own_process
LAUNCH_TIMEOUT_S = 240.0
# Four ranks: two pipeline stages, each replicated twice with ZeRO-1 (sharded optimizer state).
TRAIN = ["train", "--model", "mlp", "--schedule", "1f1b", "--pp", "2", "--dp", "2", "--zero", "1",
         "--microbatches", "2", "--no-bind-cores", "--json"]
# The killed job's steps and checkpoint interval: after its first checkpoint, enough steps
# left that the kill lands before the job ends.
STEPS, EVERY = 100, 5
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


@attrs.frozen
class Job:
    """What ``restarted_and_resumed`` ran: the uninterrupted local run's document, the
    killed-and-restarted launch's last document and stderr, and the resumed launch's document."""

    root: Path
    whole: dict[str, Any]
    last: dict[str, Any]
    err: str
    resumed: dict[str, Any]


@pytest.fixture(scope="module")
def restarted_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Four ranks under torchrun train ``STEPS`` steps, checkpointing every ``EVERY``; rank 1
    is SIGKILLed once the first checkpoint is complete, torchrun starts the job again, and it
    resumes by itself. Then a second launch resumes that job's checkpoint (``--resume``) for
    ``EVERY`` more steps. Beside them, the local runtime trains all the steps in one run. Both
    tests below check this one job: each launch of four ranks costs seconds of CPU per rank."""
    tmp_path = tmp_path_factory.mktemp("torchrun")
    (whole,), _ = _run(_local(*TRAIN, "--steps", str(STEPS + EVERY), "--checkpoint-every", str(EVERY),
                              "--checkpoint-dir", "local"), tmp_path)
    common = [*TRAIN, "--checkpoint-every", str(EVERY), "--checkpoint-dir", "spmd"]
    root = tmp_path / "spmd"
    launch = subprocess.Popen(
        _torchrun(4, *common, "--steps", str(STEPS), restarts=1),
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
    (resumed,), _ = _run(_torchrun(4, *common, "--steps", str(STEPS + EVERY), "--resume"), tmp_path)
    return Job(tmp_path, whole, last, err, resumed)


def test_torchrun_restarts_a_killed_rank_from_the_latest_checkpoint(restarted_and_resumed: Job) -> None:
    job = restarted_and_resumed
    last = job.last
    assert last["exit_code"] == 0 and "restart 1" in job.err
    assert last["first_step"] > 1, last  # resumed from a checkpoint, not from the start
    assert last["losses"] == job.whole["losses"][last["first_step"] - 1:STEPS]
    step = f"step-{STEPS:08d}"
    _assert_same_model(job.root / "spmd" / step, job.root / "local" / step)
    _no_partial(job.root / "spmd")


def test_a_run_resumed_under_torchrun_ends_as_an_uninterrupted_one(restarted_and_resumed: Job) -> None:
    job, spmd = restarted_and_resumed, restarted_and_resumed.root / "spmd"
    second = job.resumed
    assert second["first_step"] == STEPS + 1
    # With the restarted launch's losses (test above), every step since its checkpoint.
    assert job.last["losses"] + second["losses"] == job.whole["losses"][job.last["first_step"] - 1:]
    assert [s for s, _ in complete_checkpoints(spmd)] == [STEPS - EVERY, STEPS, STEPS + EVERY]  # the newest 3
    _assert_same_model(spmd, job.root / "local")
    # The ranks' files hold what the local runtime's hold, optimizer state included (not the
    # processes' random generators: the local runtime's ranks share one process's).
    for name in (f"rank-{r:05d}.safetensors" for r in range(4)):
        got, want = (load_file(job.root / run / f"step-{STEPS + EVERY:08d}" / name) for run in ("spmd", "local"))
        assert got.keys() == want.keys()
        tensors = [k for k in got if not k.startswith("object/")]
        assert tensors and all(torch.equal(got[k], want[k]) for k in tensors), name
    _no_partial(spmd)


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
