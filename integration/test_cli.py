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

from piper_runtime.options import REUSE_ENV
from piper_train.cli import main

from .conftest import Done

# No module-wide ``ray_cluster``: the tests that run the command here get the session's Ray
# through the ``piper`` fixture; the ``own_process`` ones start their commands' own clusters,
# and their pytest run then starts no Ray (seconds, and a share of a core while it idles).

ROOT = Path(__file__).resolve().parents[1]
USER_MODEL = ROOT / "integration" / "fixtures" / "user_model.py"
FAULTY_MODEL = ROOT / "integration" / "fixtures" / "faulty_model.py"
CLI_TIMEOUT_S = 240


def _processes_under(path: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", path], capture_output=True, text=True)
    return out.stdout.splitlines()


def piper_process(*args: str, console_script: bool = False, interrupt_after: str | None = None,
                  interrupt_with: signal.Signals = signal.SIGINT, whole_job: bool = False) -> Done:
    """Run the command as a process of its own (the console script, or ``python -m``),
    with the default worker policy and its own Ray temp folder, so we can tell its Ray
    processes from those of anything else on the machine, and check it leaves none behind.
    ``interrupt_after``: send ``interrupt_with`` once a line of stdout starts with this; to
    every process of the command's session with ``whole_job`` (as SLURM's scancel does)."""
    ray_tmp = tempfile.mkdtemp(prefix="piper-cli-")  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo",
               RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=ray_tmp)
    env.pop(REUSE_ENV, None)
    command = [str(Path(sys.executable).with_name("piper"))] if console_script else [sys.executable, "-m",
                                                                                     "piper_train.cli"]
    # SIGINT handled as at a terminal: a test run started in the background of a shell without
    # job control inherits it ignored, and the command (rightly) leaves an ignored SIGINT alone.
    proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT, start_new_session=whole_job, preexec_fn=_default_sigint)
    try:
        head = ""
        if interrupt_after is not None:
            head = _read_until(proc, interrupt_after, time.monotonic() + CLI_TIMEOUT_S)
            if whole_job:
                os.killpg(proc.pid, interrupt_with)
            else:
                proc.send_signal(interrupt_with)
        out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
        assert not _processes_under(ray_tmp), "the command left Ray processes behind"
    finally:
        proc.kill()
        proc.communicate()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return Done(proc.returncode, head + out, err)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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


@pytest.mark.own_process
@pytest.mark.parametrize("whole_job", [False, True], ids=["driver", "whole-job"])
def test_sigterm_stops_at_a_step_with_a_checkpoint_and_exits_143(tmp_path, whole_job, runtime, request, capsys):
    """SIGTERM to the driver (Kubernetes signals a pod's first process): the run ends after
    the steps already sent, checkpoints the last, says so, and a run resumes from it. To every
    process of the job (SLURM): the same, unless the raylet's end takes the workers first,
    which the command then says; either way exit 143, no traceback, nothing left running."""
    ckpt = tmp_path / "ckpt"
    base = ["train", "--model", "mlp", "--pp", "2", "--checkpoint-dir", str(ckpt)]
    done = piper_process(*base, "--steps", "100000", "--checkpoint-every", "100000", interrupt_after="step ",
                         interrupt_with=signal.SIGTERM, whole_job=whole_job)
    assert done.returncode == 143, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "SIGTERM received" not in done.stderr  # Ray's own handler
    said = [line for line in done.stderr.splitlines() if line.startswith("piper train: stopped on SIGTERM")]
    assert len(said) == 1, done.stderr
    last = int(said[0].split("after step ")[1].split(";")[0])
    written = [p.name for p in ckpt.iterdir()]
    if whole_job and not written:
        assert "no checkpoint was written (the workers ended first: " in said[0]
        return
    assert written == [f"step-{last:08d}"]
    assert f"the latest checkpoint is {ckpt / f'step-{last:08d}'} (--resume continues from it)" in said[0]
    # Resumed in this process: on the local runtime without the session's Ray (on Ray, with it).
    piper = request.getfixturevalue("piper") if runtime == "ray" else _here(capsys)
    resumed = piper(*base, "--steps", str(last + 2), "--resume", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["first_step"] == last + 1


def _here(capsys: pytest.CaptureFixture[str]):
    """``piper ARGS`` in this process, as the ``piper`` fixture runs it but without starting
    the session's Ray first (for a run on the local runtime, which needs none)."""

    def run(*args: str) -> Done:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return Done(code, out, err)

    return run


_UNCLOSED = f"""
import sys
sys.path.insert(0, {str(USER_MODEL.parent)!r})
from user_model import make
from piper_directives import one_f_one_b
from piper_train import Trainer

model, x, y, loss = make()
trainer = Trainer(model, x, y, loss, one_f_one_b(pp=2, microbatches=2, stages=4))
print(trainer.step(x, y).loss)
"""


@pytest.mark.own_process
def test_a_script_that_never_closes_its_trainer_exits_and_leaves_nothing_behind():
    """The runtime's finalizer runs at interpreter exit after Ray's own exit hook; a Ray call
    there used to start a second local Ray instance, whose agents outlived the script."""
    ray_tmp = tempfile.mkdtemp(prefix="piper-unclosed-")
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo",
               RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=ray_tmp)
    env.pop(REUSE_ENV, None)
    try:
        done = subprocess.run([sys.executable, "-c", _UNCLOSED], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=CLI_TIMEOUT_S)
        assert done.returncode == 0, done.stderr
        assert float(done.stdout) > 0 and "Started a local Ray instance" not in done.stderr
        deadline = time.monotonic() + 10  # the reaper's kill lands within a second
        while _processes_under(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _processes_under(ray_tmp), "the script left Ray processes behind"
    finally:
        for line in _processes_under(ray_tmp):
            os.kill(int(line.split()[0]), signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.own_process
@pytest.mark.ray
@pytest.mark.parametrize("after", ["captured", "backend"])  # as Ray starts; as the workers are set up
def test_sigterm_while_workers_start_ends_the_command_with_143_and_no_traceback(after):
    """Ray replaces SIGTERM's handler in ``ray.init`` and turns a handler's exception inside
    ``ray.wait`` into a ``SystemError`` unless it is a ``KeyboardInterrupt``: wherever the
    signal lands while the run starts, it ends cleanly."""
    done = piper_process("train", "--model", "mlp", "--pp", "2", "--steps", "100000",
                         interrupt_after=after, interrupt_with=signal.SIGTERM)
    assert done.returncode == 143, done.stdout + done.stderr
    assert "piper train: terminated (SIGTERM)" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.own_process
@pytest.mark.ray
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


def test_check_warns_when_the_loss_is_not_a_mean_over_the_batch(piper):
    """The strategy still matches single-device training on the same microbatches (exit 0),
    but a summed loss makes training on microbatches differ from the whole batch: said."""
    done = piper("check", "--model", f"{USER_MODEL}:summed", "--steps", "1", "--json")
    assert done.returncode == 0
    summary = json.loads(done.stdout)
    assert summary["ok"] and summary["whole_batch_loss_matches"] is False
    assert "WARNING: the loss of the whole first batch is" in done.stderr and "a sum instead of a mean?" in done.stderr
    done = piper("check", "--model", f"{USER_MODEL}:make", "--steps", "1", "--json")
    assert json.loads(done.stdout)["whole_batch_loss_matches"] is True and "WARNING" not in done.stderr


def test_check_leaves_out_parameters_whose_gradient_is_noise_under_adam(piper):
    """Attention's key bias: softmax cancels it, so its gradient is rounding noise, summed
    over two replicas in another order than on one device; AdamW turns that into updates of
    about its learning rate in either direction, which failed check with a correct strategy.
    Its gradients are still compared; SGD's parameters are compared whole."""
    model = f"{USER_MODEL}:attention"
    done = piper("check", "--model", model, "--dp", "2", "--steps", "3", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["params_not_compared"] == 2 * 16  # the key biases of both layers
    assert "32 parameter entries not compared after the steps" in done.stderr
    done = piper("check", "--model", model, "--dp", "2", "--steps", "3", "--optimizer", "sgd", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["params_not_compared"] == 0


def test_check_fails_on_a_real_difference(piper):
    """Python state baked into the captured code at trace time (a known limit of capture)."""
    done = piper("check", "--model", f"{USER_MODEL}:drifting", "--pp", "5", "--microbatches", "2", "--steps", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL: differences exceed" in done.stdout


def test_check_compares_with_dropout_on(piper):
    """Dropout draws the same masks under the strategy as on one device (seeded per region,
    microbatch, step and replica), and --seed reaches the workers: the check passes with any
    seed, while the seed changes the masks (and so the loss)."""
    losses = []
    for seed in ("0", "1"):
        done = piper("check", "--model", f"{USER_MODEL}:noisy", "--pp", "5", "--microbatches", "2", "--steps", "2",
                     "--optimizer", "sgd", "--seed", seed)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "PASS" in done.stdout
        losses.append([line for line in done.stdout.splitlines() if line.startswith("step 0: loss")])
    assert losses[0] != losses[1]


def test_negative_tolerance_is_refused(piper):
    done = piper("check", "--model", "mlp", "--atol", "-1")
    assert done.returncode == 2 and "--atol must be >= 0" in done.stderr


@pytest.mark.own_process
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


def test_a_schedule_from_flags_is_said_to_come_from_the_command_line(piper):
    """A user of the command wrote no line of code: a directive the command made from its
    flags names those flags, not a line of Piper's source."""
    done = piper("train", "--model", f"{USER_MODEL}:make", "--microbatches", "3", "--steps", "1")
    assert done.returncode == 2 and "8 samples along its batch dimension, not divisible into 3" in done.stderr
    assert "Split(microbatches=3) at the command line (--schedule 1f1b --pp 2 --microbatches 3)" in done.stderr
    done = piper("train", "--model", f"{USER_MODEL}:make", "--pp", "4", "--dp", "3", "--steps", "1")
    assert done.returncode == 2 and "not divisible among 3 data-parallel replicas" in done.stderr
    assert "at the command line (--dp 3 --zero 0 --tp 1 --ep 1)" in done.stderr
    assert "request.py" not in done.stderr


@pytest.mark.parametrize("pp", [3])
def test_regions_not_divisible_by_ranks(piper, pp):
    done = piper("train", "--model", f"{USER_MODEL}:make", "--pp", str(pp), "--steps", "1")
    assert done.returncode == 2 and "4 stages cannot be spread evenly over 3" in done.stderr


@pytest.mark.own_process
@pytest.mark.ray
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_naming_what_is_missing():
    # A process of its own: in-process, the tests' Ray cluster is already up.
    done = piper_process("train", "--model", "mlp", "--pp", "2", "--steps", "1", "--backend", "cuda")
    assert done.returncode == 2, done.stderr
    assert "backend 'cuda' needs a GPU for each rank" in done.stderr
    assert "torch.cuda.is_available() is False" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.own_process
@pytest.mark.ray
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


@pytest.mark.ray
def test_train_says_which_backend_it_chose(piper):
    done = piper("train", "--model", "mlp", "--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--steps", "1",
                 "--placement", "spread", "--no-bind-cores")
    assert done.returncode == 0, done.stderr
    assert "backend 'cpu' (the Ray cluster has no GPU)" in done.stdout or "backend 'cuda'" in done.stdout
    assert "cores: not bound (bind_cores=False)" in done.stdout  # bound by default: test_runtime.py


@pytest.mark.ray
def test_a_hung_rank_stops_the_run_with_exit_code_3_naming_it(piper):
    """Region 1's forward never returns on rank 1: within the 3 s bound (plus the watchdog's
    look), the run stops naming rank 1, the instruction, and rank 0 waiting for it."""
    done = piper("train", "--model", f"{FAULTY_MODEL}:hang", "--pp", "2", "--microbatches", "2", "--steps", "2",
                 "--timeout", "3")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "piper train: run failed: step 1: rank 1 is stuck: no progress for" in done.stderr
    assert "(bound 3 s), in compute F.s1.mb0 (s1:F0), microbatch 0" in done.stderr
    assert "rank 0: in recv" in done.stderr and "from rank 1" in done.stderr
    assert "step    1/2" not in done.stdout


def test_timeout_must_be_positive(piper):
    done = piper("check", "--model", "mlp", "--timeout", "0")
    assert done.returncode == 2 and "--timeout must be > 0" in done.stderr


def test_a_nan_loss_stops_the_run_naming_step_microbatch_and_rank(piper):
    done = piper("train", "--model", f"{FAULTY_MODEL}:nan", "--pp", "2", "--microbatches", "2", "--steps", "3")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "run failed: step 2: the loss of microbatch 1 is nan (rank 1)" in done.stderr
    assert "step    1/3" in done.stdout and "step    2/3" not in done.stdout


def test_skip_step_goes_on_and_json_stays_standard(piper):
    done = piper("train", "--model", f"{FAULTY_MODEL}:nan", "--pp", "2", "--microbatches", "2", "--steps", "3",
                 "--on-nan", "skip-step", "--json")
    assert done.returncode == 0, done.stderr
    assert "step 2: the loss of microbatch 1 is nan (rank 1); step skipped" in done.stderr
    # Standard JSON: a parser that refuses bare NaN/Infinity reads it.
    summary = json.loads(done.stdout, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert summary["skipped_steps"] == [2] and summary["losses"][1] == "NaN"
    assert all(isinstance(x, float) for x in (summary["losses"][0], summary["losses"][2]))


def _alive(pids: dict[int, str]) -> list[str]:
    """Those of ``pids`` (pid -> command line) still running (not gone, not a zombie)."""
    alive = []
    for pid, command in pids.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(f"{pid} {command}")
    return alive


@pytest.mark.own_process
@pytest.mark.ray
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigkilled_driver_takes_the_embedded_clusters_processes_with_it():
    """Without the reaper, Ray's dashboard and runtime-env agents outlive a SIGKILLed driver
    by about a minute; with it, every process the driver started is gone within seconds."""
    from piper_runtime.driver.reaper import descendants

    ray_tmp = tempfile.mkdtemp(prefix="piper-kill-")
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo",
               RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=ray_tmp)
    env.pop(REUSE_ENV, None)
    started: dict[int, str] = {}
    proc = subprocess.Popen([sys.executable, "-m", "piper_train.cli", "train", "--model", "mlp", "--pp", "2",
                             "--steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, cwd=ROOT)
    try:
        _read_until(proc, "step ", time.monotonic() + CLI_TIMEOUT_S)
        started = {pid: Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:80]
                   for pid in descendants(proc.pid)}
        assert any("DashboardAgent" in c for c in started.values()), started  # what used to linger
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30  # they used to linger for 60-70 s
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(started), f"still running after the driver was killed: {_alive(started)}"
    finally:
        proc.kill()
        proc.communicate()
        for line in _alive(started):  # nothing may outlive the test, whatever happened
            os.kill(int(line.split()[0]), signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
