"""The ``piper`` command end to end.

Most tests call ``piper_train.cli.main(argv)`` in this process, so they share the session's
Ray cluster and its pooled workers: what they check (exit codes, what goes to stdout and
stderr) does not depend on the process. A few run the command as its own process, for what
only a process shows: the console script, no traceback on stderr, Ctrl-C, no Ray process
left behind.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from piper_runtime.pool import REUSE_ENV

from .conftest import Done

pytestmark = pytest.mark.usefixtures("ray_cluster")

ROOT = Path(__file__).resolve().parents[1]
USER_MODEL = ROOT / "integration" / "fixtures" / "user_model.py"
CLI_TIMEOUT_S = 240


def _processes_under(path: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", path], capture_output=True, text=True)
    return out.stdout.splitlines()


def piper_process(*args: str, console_script: bool = False, interrupt_after: str | None = None) -> Done:
    """Run the command as a process of its own (the console script, or ``python -m``),
    with the default worker policy and its own Ray temp folder, so we can tell its Ray
    processes from those of anything else on the machine, and check it leaves none behind.
    ``interrupt_after``: send SIGINT once a line of stdout starts with this."""
    ray_tmp = tempfile.mkdtemp(prefix="piper-cli-")  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo",
               RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=ray_tmp)
    env.pop(REUSE_ENV, None)
    command = [str(Path(sys.executable).with_name("piper"))] if console_script else [sys.executable, "-m",
                                                                                     "piper_train.cli"]
    proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)
    try:
        head = ""
        if interrupt_after is not None:
            head = _read_until(proc, interrupt_after, time.monotonic() + CLI_TIMEOUT_S)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
        assert not _processes_under(ray_tmp), "the command left Ray processes behind"
    finally:
        proc.kill()
        proc.communicate()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return Done(proc.returncode, head + out, err)


def _read_until(proc: subprocess.Popen, prefix: str, deadline: float) -> str:
    """What ``proc`` printed on stdout up to and including the first line starting with
    ``prefix`` (fails at ``deadline``)."""
    lines = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break  # the process ended
        lines.append(line)
        if line.startswith(prefix):
            return "".join(lines)
    raise AssertionError(f"no line starting with {prefix!r} on stdout; got:\n{''.join(lines)}")


def test_train_prints_progress_and_a_json_summary(piper):
    done = piper("train", "--model", "mlp", "--schedule", "gpipe", "--pp", "2", "--microbatches", "4",
                 "--steps", "12", "--json")
    assert done.returncode == 0, done.stderr
    assert "step   12/12" in done.stderr  # progress goes to stderr when --json owns stdout
    summary = json.loads(done.stdout)
    assert summary["pp"] == 2 and summary["microbatches"] == 4 and len(summary["losses"]) == 12
    losses = summary["losses"]
    assert sum(losses[-3:]) < sum(losses[:3])  # it learns (batches differ, so compare averages)


def test_the_console_script_trains_and_leaves_nothing_behind():
    """The installed ``piper`` script in a process of its own, starting (and stopping) its
    own Ray with new workers."""
    done = piper_process("train", "--model", "mlp", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2",
                         "--steps", "2", "--json", console_script=True)
    assert done.returncode == 0, done.stderr
    assert "step    2/2" in done.stderr and "Traceback" not in done.stderr
    summary = json.loads(done.stdout)
    assert summary["pp"] == 2 and summary["microbatches"] == 2 and len(summary["losses"]) == 2


def test_an_interrupted_run_exits_with_130_and_stops_its_workers():
    done = piper_process("train", "--model", "mlp", "--pp", "2", "--steps", "100000", interrupt_after="step ")
    assert done.returncode == 130, done.stdout + done.stderr
    assert "step    1/100000" in done.stdout
    assert "piper train: interrupted" in done.stderr and "Traceback" not in done.stderr


def test_check_a_user_factory_with_two_regions_per_rank(piper):
    done = piper("check", "--model", f"{USER_MODEL}:make", "--schedule", "1f1b", "--pp", "2",
                 "--microbatches", "4", "--optimizer", "sgd", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["max_grad_rel"] < 1e-5
    assert "largest grad  difference" in done.stderr and "PASS" in done.stderr


def test_check_moe_with_expert_parallelism(piper):
    done = piper("check", "--model", "moe", "--pp", "2", "--ep", "2", "--microbatches", "2", "--steps", "2",
                 "--optimizer", "sgd", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"], report
    assert "ep=2" in done.stderr and "PASS" in done.stderr


def test_check_moe_with_expert_parallelism_nested_in_data_parallelism(piper):
    """--ep 2 --dp 2 --zero 1 on 4 ranks: experts split over (0, 1) and (2, 3), each expert
    reduced over the two ranks holding it, the rest ZeRO-1 over all four."""
    done = piper("check", "--model", "moe", "--pp", "1", "--ep", "2", "--dp", "2", "--zero", "1",
                 "--microbatches", "2", "--steps", "2", "--optimizer", "sgd", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["ok"]
    assert "dp=2, tp=1, ep=2, zero=1" in done.stderr and "PASS" in done.stderr


def test_check_fails_on_a_real_difference(piper):
    done = piper("check", "--model", f"{USER_MODEL}:noisy", "--pp", "5", "--microbatches", "2", "--steps", "1")
    assert done.returncode == 1, done.stderr
    assert "FAIL: differences exceed" in done.stdout


def test_negative_tolerance_is_refused(piper):
    done = piper("check", "--model", "mlp", "--atol", "-1")
    assert done.returncode == 2 and "--atol must be >= 0" in done.stderr


def test_compute_outside_annotations_is_reported_cleanly():
    """A user mistake ends the process with exit code 2 and a message, no traceback."""
    done = piper_process("train", "--model", f"{USER_MODEL}:leaky", "--pp", "2", "--steps", "1")
    assert done.returncode == 2
    assert "outside every annotate" in done.stderr and "mul" in done.stderr
    assert "Traceback" not in done.stderr


def test_malformed_strategy_file(piper, tmp_path):
    bad = tmp_path / "strategy.json"
    bad.write_text('{"directives": [{"op": "place", "filter": {"PP": 0}, "devices": [0, 0]}]}')
    done = piper("train", "--model", "mlp", "--strategy", str(bad), "--steps", "1")
    assert done.returncode == 2
    assert "device 0 is named twice" in done.stderr and "strategy.json#0" in done.stderr


def test_unknown_model_and_bad_factory(piper):
    done = piper("train", "--model", "gpt5", "--steps", "1")
    assert done.returncode == 2 and "unknown model 'gpt5'" in done.stderr
    done = piper("train", "--model", f"{USER_MODEL}:nothing", "--steps", "1")
    assert done.returncode == 2 and "has no callable 'nothing'" in done.stderr


@pytest.mark.parametrize("pp", [3])
def test_regions_not_divisible_by_ranks(piper, pp):
    done = piper("train", "--model", f"{USER_MODEL}:make", "--pp", str(pp), "--steps", "1")
    assert done.returncode == 2 and "4 stages cannot be spread evenly over 3" in done.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_naming_what_is_missing():
    # A process of its own: in-process, the tests' Ray cluster is already up.
    done = piper_process("train", "--model", "mlp", "--pp", "2", "--steps", "1", "--backend", "cuda")
    assert done.returncode == 2, done.stderr
    assert "backend 'cuda' needs a GPU for each rank" in done.stderr
    assert "torch.cuda.is_available() is False" in done.stderr and "Traceback" not in done.stderr


def test_an_unreachable_address_is_refused_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound but not listening: nothing answers there
        address = f"127.0.0.1:{s.getsockname()[1]}"
        # A process of its own: in-process, the tests' Ray cluster is already connected.
        done = piper_process("check", "--model", "mlp", "--pp", "2", "--steps", "1", "--address", address)
    assert done.returncode == 2, done.stderr
    assert f"cannot reach the Ray cluster at '{address}'" in done.stderr and "Traceback" not in done.stderr


def test_ranks_per_gpu_must_be_positive(piper):
    done = piper("train", "--model", "mlp", "--ranks-per-gpu", "0")
    assert done.returncode == 2 and "--ranks-per-gpu must be >= 1" in done.stderr


def test_train_says_which_backend_it_chose(piper):
    done = piper("train", "--model", "mlp", "--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--steps", "1",
                 "--placement", "spread")
    assert done.returncode == 0, done.stderr
    assert "backend 'cpu' (the Ray cluster has no GPU)" in done.stdout or "backend 'cuda'" in done.stdout
