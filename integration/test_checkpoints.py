"""Checkpoints on Ray (gloo, CPU), small MLPs:

- resume is exact: 2N steps in one run equal N steps, a new trainer resuming from the
  checkpoint, and N more (every loss and parameter bit for bit, fp32 AdamW), under DualPipeV
  x DP=2 x ZeRO-3 and 1F1B x DP=2 x ZeRO-1 (shards stepped as decay pieces);
- resharding: a checkpoint of DualPipeV x DP=2 x ZeRO-3 continues under 1F1B on 4 ranks and on
  one device with single-device training's losses and parameters (fp64, optimizer state
  included), and ``export`` gives a ``state_dict`` the model loads;
- fault tolerance: a worker SIGKILLed twice mid-run; ``fit`` restarts and finishes with the
  parameters of an uninterrupted run, recomputing the steps after each checkpoint (also,
  killed once, with two steps per call);
- a run of one epoch resumed for a second trains that epoch whole, with the losses of one
  run of two epochs;
- a stop asked for mid-run (SIGTERM in ``piper train``) ends at a step with its checkpoint,
  and the run resumed from it ends like an uninterrupted one;
- tensor- and expert-parallel strategies (parameters cut across ranks, ZeRO-3 shards of the
  pieces) resume exactly, and reshard onto one device.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from piper_directives import build_schedule
from piper_ir import CheckpointError, ExecutionError
from piper_runtime import OptimizerSpec
from piper_train.checkpoints import Checkpoints, export, read_manifest
from piper_train.cli import main
from piper_train.loop import fit
from piper_train.models import build_model
from piper_train.reference import ReferenceTrainer
from piper_train.stopping import StopRequest
from piper_train.trainer import Trainer
from piper_train.workload import load_factory

pytestmark = pytest.mark.usefixtures("ray_cluster")
ADAMW = OptimizerSpec("adamw", 1e-2, weight_decay=0.1)
FIXTURE = Path(__file__).parent / "fixtures" / "data_model.py"
USER_MODEL = Path(__file__).parent / "fixtures" / "user_model.py"


def _trainer(workload, strategy, optimizer=ADAMW) -> Trainer:
    return Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn, strategy,
                   optimizer=optimizer)


def _uninterrupted(workload, strategy, steps: int):
    """A run of ``steps`` steps without checkpoints or faults, and its final parameters: the
    oracle a stopped, resumed or restarted run must match bit for bit."""
    with _trainer(workload, strategy) as trainer:
        return fit(trainer, workload.stream(), steps=steps), trainer.parameters()


@functools.cache
def _oracle(seed: int, steps: int, runtime: str):
    """``_uninterrupted`` for the MLP of ``seed`` under 1F1B on two ranks (two microbatches)
    on ``runtime``: the oracle of several tests below, computed once for them all."""
    return _uninterrupted(build_model("mlp", stages=2, seed=seed), build_schedule("1f1b", 2, 2, stages=2), steps)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize(
    ("schedule", "zero", "asynchronous"), [("dualpipev", 3, False), ("1f1b", 1, False), ("1f1b", 1, True)],
    ids=["dualpipev-dp2-zero3", "1f1b-dp2-zero1", "1f1b-dp2-zero1-written-while-training"]
)
def test_resume_is_exact(schedule, zero, asynchronous, tmp_path) -> None:
    n = 3
    workload = build_model("mlp", stages=4, seed=11)
    strategy = build_schedule(schedule, 2, 4, stages=4, dp=2, zero=zero)
    with _trainer(workload, strategy) as trainer:
        whole = fit(trainer, workload.stream(), steps=2 * n)
        expected = trainer.parameters()
    root = Checkpoints(tmp_path, every=n, asynchronous=asynchronous)
    with _trainer(workload, strategy) as trainer:
        first = fit(trainer, workload.stream(), steps=n, checkpoints=root)
    assert [p.name for p in first.checkpoints] == [f"step-{n:08d}"]
    with _trainer(workload, strategy) as trainer:  # a new process's view: the initial model, then the checkpoint
        second = fit(trainer, workload.stream(), steps=2 * n, checkpoints=root, resume=True)
        resumed = trainer.parameters()
        # The same program: each rank's own generators were restored too.
        assert read_manifest(first.checkpoints[0])["program"] == trainer.program_digest
    assert [m.step for m in second.steps] == list(range(n + 1, 2 * n + 1))
    assert [m.loss for m in first.steps + second.steps] == [m.loss for m in whole.steps]
    assert [m.lr for m in first.steps + second.steps] == [m.lr for m in whole.steps]
    assert _equal(resumed, expected)


def test_a_checkpoint_reshards_to_other_strategies_and_exports(tmp_path) -> None:
    n = 2
    workload = build_model("mlp", stages=4, seed=12, dtype=torch.float64)
    reference = ReferenceTrainer(workload.model, workload.loss_fn, ADAMW, 4)
    expected = [reference.step(*workload.batches(step)) for step in range(2 * n)]
    root = Checkpoints(tmp_path / "ckpt", every=n)
    with _trainer(workload, build_schedule("dualpipev", 2, 4, stages=4, dp=2, zero=3)) as trainer:
        first = fit(trainer, workload.stream(), steps=n, checkpoints=root)
        saved = trainer.parameters()
    out = tmp_path / "model.pt"
    state = export(root.root, out)
    model = build_model("mlp", stages=4, seed=12, dtype=torch.float64).model
    model.load_state_dict(torch.load(out))  # strict: every name and shape
    assert _equal({k: v for k, v in model.state_dict().items()}, saved) and _equal(state, saved)
    for strategy in (build_schedule("1f1b", 4, 4, stages=4), build_schedule("gpipe", 1, 4, stages=4)):
        with _trainer(workload, strategy) as trainer:
            trainer.state.data = workload.stream()
            trainer.load_checkpoint(root.root)
            assert _equal(trainer.parameters(), saved)  # loaded exactly, whatever the layout
            second = fit(trainer, trainer.state.data, steps=2 * n)
            params = trainer.parameters()
        losses = [m.loss for m in first.steps + second.steps]
        # Optimizer state included: a fresh AdamW state would move the losses by far more.
        assert losses == pytest.approx([r.loss for r in expected], rel=1e-10, abs=1e-12)
        want = reference.parameters()
        assert all(torch.allclose(params[k], want[k], rtol=1e-9, atol=1e-12) for k in want)


def test_a_tied_head_and_dropout_resume_under_another_schedule(tmp_path) -> None:
    """GPT-2 (tied embedding and head, dropout 0.1) saved under DualPipeV and resumed under
    1F1B continues exactly as 1F1B would have: both copies of the tie come back, and the
    dropout masks, drawn from (seed, region, microbatch, step), follow the restored step."""
    from piper_train.workload import load_workload

    example = Path(__file__).resolve().parents[1] / "examples" / "gpt2" / "model.py"
    workload = load_workload(f"{example}:tiny", stages=4, seed=0)
    one_f_one_b, dualpipev = build_schedule("1f1b", 2, 4, stages=4), build_schedule("dualpipev", 2, 4, stages=4)
    with _trainer(workload, one_f_one_b) as trainer:
        whole = fit(trainer, workload.stream(), steps=4)
        expected = trainer.parameters()
    root = Checkpoints(tmp_path, every=2)
    with _trainer(workload, dualpipev) as trainer:
        first = fit(trainer, workload.stream(), steps=2, checkpoints=root)
    with _trainer(workload, one_f_one_b) as trainer:
        trainer.state.data = workload.stream()
        trainer.load_checkpoint(root.root)
        second = fit(trainer, trainer.state.data, steps=4)
        resumed = trainer.parameters()
    assert [m.step for m in second.steps] == [3, 4]
    losses = [m.loss for m in first.steps + second.steps]
    assert losses == pytest.approx([m.loss for m in whole.steps], rel=1e-6, abs=1e-7)
    assert losses[2] != losses[3]  # different batches and masks each step
    assert resumed.keys() == expected.keys()
    assert all(torch.allclose(resumed[k], expected[k], rtol=1e-5, atol=1e-6) for k in expected)
    # Exported, the tie is there under both of the model's names, and loads strictly.
    state = export(root.root, tmp_path / "gpt2.pt")
    model = load_workload(f"{example}:tiny", stages=4, seed=0).model
    model.load_state_dict(torch.load(tmp_path / "gpt2.pt"))
    assert torch.equal(model.lm_head.weight, state["transformer.wte.weight"])


def test_another_models_checkpoint_is_refused(tmp_path) -> None:
    workload = build_model("mlp", stages=2, seed=1)
    with _trainer(workload, build_schedule("1f1b", 2, 2, stages=2)) as trainer:
        fit(trainer, workload.stream(), steps=1, checkpoints=Checkpoints(tmp_path))
    other = build_model("mlp", stages=4, seed=1)
    with _trainer(other, build_schedule("1f1b", 2, 2, stages=4)) as trainer:
        with pytest.raises(CheckpointError, match="saved from another model: parameters missing"):
            trainer.load_checkpoint(tmp_path)
        with pytest.raises(CheckpointError, match="already holds checkpoints"):
            fit(trainer, other.stream(), steps=1, checkpoints=Checkpoints(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]


def test_a_checkpoint_the_disk_refuses_fails_the_run_and_keeps_the_ones_before(tmp_path, monkeypatch) -> None:
    """The driver's side of a checkpoint failing (a full disk) ends the run with an
    ``ExecutionError`` naming the checkpoint (exit code 3 from the command), never a
    traceback, and leaves the checkpoints already written complete."""
    workload = build_model("mlp", stages=2, seed=1)
    with _trainer(workload, build_schedule("1f1b", 2, 2, stages=2)) as trainer:
        real = trainer.save_checkpoint

        def full_after_the_first(path):
            if trainer.state.step > 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real(path)

        monkeypatch.setattr(trainer, "save_checkpoint", full_after_the_first)
        with pytest.raises(ExecutionError, match="no space left on device writing checkpoint .*step-00000002"):
            fit(trainer, workload.stream(), steps=3, checkpoints=Checkpoints(tmp_path, every=1), steps_per_call=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    assert read_manifest(tmp_path / "step-00000001")["step"] == 1


@pytest.mark.parametrize(
    ("model", "strategy"),
    [("transformer", build_schedule("1f1b", 1, 2, stages=2, tp=2, dp=2, zero=3)),
     ("moe", build_schedule("gpipe", 1, 2, stages=2, ep=2, zero=1)),
     ("moe", build_schedule("gpipe", 1, 2, stages=2, tp=2, ep=2, zero=1))],
    ids=["tp2-dp2-zero3", "ep2-zero1", "tp2-ep2-zero1"],
)
def test_tensor_and_expert_parallel_checkpoints_resume_exactly_and_reshard(model, strategy, tmp_path) -> None:
    """Parameters cut across ranks (a fused q/k/v weight in three blocks, experts), their ZeRO
    shards and their AdamW state are written as pieces of the single-device tensors: the run
    resumes bit for bit under its own strategy, and on one device with single-device
    training's losses and parameters (fp64; the Adam moments come back cut right, or the
    losses would miss by far more)."""
    n = 2
    workload = build_model(model, stages=2, seed=13, dtype=torch.float64)
    reference = ReferenceTrainer(workload.model, workload.loss_fn, ADAMW, 2)
    expected = [reference.step(*workload.batches(step)) for step in range(2 * n)]
    with _trainer(workload, strategy) as trainer:
        whole = fit(trainer, workload.stream(), steps=2 * n)
        uninterrupted = trainer.parameters()
    root = Checkpoints(tmp_path, every=n)
    with _trainer(workload, strategy) as trainer:
        first = fit(trainer, workload.stream(), steps=n, checkpoints=root)
        saved = trainer.parameters()
    with _trainer(workload, strategy) as trainer:
        fit(trainer, workload.stream(), steps=2 * n, checkpoints=root, resume=True)
        assert _equal(trainer.parameters(), uninterrupted)
    with _trainer(workload, build_schedule("gpipe", 1, 2, stages=2)) as trainer:
        trainer.state.data = workload.stream()
        trainer.load_checkpoint(first.checkpoints[0])  # step n (the resumed run wrote step 2n)
        assert _equal(trainer.parameters(), saved)  # every piece where it belongs
        second = fit(trainer, trainer.state.data, steps=2 * n)
        params = trainer.parameters()
    assert [m.loss for m in first.steps] == [m.loss for m in whole.steps[:n]]
    losses = [m.loss for m in first.steps + second.steps]
    assert losses == pytest.approx([r.loss for r in expected], rel=1e-9, abs=1e-12)
    want = reference.parameters()
    assert all(torch.allclose(params[k], want[k], rtol=1e-8, atol=1e-11) for k in want)


def test_cli_checkpoints_and_exports_a_tensor_parallel_gpt(tmp_path, capsys) -> None:
    """A small GPT with a tied head, trained with --tp 2 and checkpointed, resumes from its
    checkpoint, and its export loads into the model as written."""
    ckpt = tmp_path / "ckpt"
    base = ["train", "--model", f"{USER_MODEL}:gpt", "--pp", "1", "--tp", "2", "--json", "--no-progress-bar",
            "--checkpoint-dir", str(ckpt)]
    assert main([*base, "--steps", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"][-1].endswith("step-00000002")
    assert main([*base, "--steps", "3", "--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["first_step"] == 3
    assert main(["export", str(ckpt), "--out", str(tmp_path / "gpt.pt")]) == 0
    load_factory(f"{USER_MODEL}:gpt").model.load_state_dict(torch.load(tmp_path / "gpt.pt"))


class _StepSink:
    """A sink that only watches steps (``on_step``)."""

    def on_eval(self, metrics) -> None:
        pass

    def close(self) -> None:
        pass


class _Killer(_StepSink):
    """A sink that SIGKILLs one worker process after the given steps (once each)."""

    def __init__(self, trainer: Trainer, at: set[int]) -> None:
        self.trainer, self.at = trainer, set(at)
        self.killed: list[tuple[int, int, float]] = []  # (step, pid, when)
        self.first_after: list[float] = []  # when each restarted run began its first step

    def on_step(self, metrics, result) -> None:
        began = time.perf_counter() - metrics.step_seconds
        # A step reported after a kill may have run before it (sent ahead, or in the same call).
        if len(self.first_after) < len(self.killed) and began > self.killed[-1][2]:
            self.first_after.append(began)
        if metrics.step in self.at:
            self.at.discard(metrics.step)
            pid = self.trainer.worker_pids()[1]
            os.kill(pid, signal.SIGKILL)
            self.killed.append((metrics.step, pid, time.perf_counter()))


@pytest.mark.ray  # kills a worker process
@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_restarts_after_killed_workers_finish_like_an_uninterrupted_run(tmp_path, steps_per_call, runtime) -> None:
    """Killed twice, one step per call: a restarted run restarts again. Two steps per call,
    killed once: which call fails and what is recomputed (every restart takes the same path
    whatever it follows; each start of new workers costs seconds)."""
    steps, every = 10, 3
    kills = {1: {4, 8}, 2: {4}}[steps_per_call]
    workload = build_model("mlp", stages=2, seed=13)
    strategy = build_schedule("1f1b", 2, 2, stages=2)
    whole, expected = _oracle(13, steps, runtime)
    with _trainer(workload, strategy) as trainer:
        killer = _Killer(trainer, kills)
        run = fit(trainer, workload.stream(), steps=steps, checkpoints=Checkpoints(tmp_path / "b", every),
                  sinks=[killer], max_restarts=2, steps_per_call=steps_per_call)
        params = trainer.parameters()
        pids = trainer.worker_pids()
    assert [r.resumed_from for r in run.restarts] == [3, 6][: len(kills)]
    # fit sends step k + 1 before step k's result reaches the sinks: the worker killed after
    # step k may have finished step k + 1 already (then step k + 2, or the checkpoint after
    # it, is what fails), so steps 4 (and 5); 7, 8 (and 9) are recomputed. Two steps per
    # call: the calls are [4, 5], [6] (a checkpoint follows); the one sent after the killed
    # step's call may have finished, then the checkpoint after it fails.
    failed = ([5, 9], [5, 10], [6, 9], [6, 10]) if steps_per_call == 1 else ([6], [7])
    assert [r.failed_step for r in run.restarts] in failed
    assert [r.recomputed for r in run.restarts] == [r.failed_step - 1 - r.resumed_from for r in run.restarts]
    assert not {pid for _, pid, _ in killer.killed} & set(pids)  # new workers
    assert [m.step for m in run.steps] == list(range(1, steps + 1))
    assert [m.loss for m in run.steps] == [m.loss for m in whole.steps]
    assert _equal(params, expected)
    for (step, _, killed), back, restart in zip(killer.killed, killer.first_after, run.restarts, strict=True):
        print(f"killed after step {step}: training again after {back - killed:.2f} s "
              f"(restart and load {restart.seconds:.2f} s), {restart.recomputed} steps recomputed")


@pytest.mark.ray  # kills a worker process
def test_checkpoints_written_while_training_goes_on_survive_killed_workers(tmp_path, runtime) -> None:
    """With the ranks writing each checkpoint while the next steps run, a worker killed
    meanwhile takes that checkpoint with it (its temporary directory removed): the run goes
    back to the latest complete one and still ends with an uninterrupted run's losses and
    parameters, and every checkpoint it kept is complete."""
    steps, every = 10, 3
    workload = build_model("mlp", stages=2, seed=13)
    strategy = build_schedule("1f1b", 2, 2, stages=2)
    whole, expected = _oracle(13, steps, runtime)
    root = Checkpoints(tmp_path, every, keep=10, asynchronous=True)
    with _trainer(workload, strategy) as trainer:
        killer = _Killer(trainer, {4, 8})
        run = fit(trainer, workload.stream(), steps=steps, checkpoints=root, sinks=[killer], max_restarts=2)
        params = trainer.parameters()
    assert len(run.restarts) == 2
    # The latest checkpoint complete when the rank died: the one before, if it was still being written.
    assert run.restarts[0].resumed_from in (0, 3) and run.restarts[1].resumed_from in (3, 6)
    assert [m.loss for m in run.steps] == [m.loss for m in whole.steps]
    assert _equal(params, expected)
    assert [p.name for p in run.checkpoints][-2:] == ["step-00000009", "step-00000010"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({p.name for p in run.checkpoints})  # no .tmp- left
    assert all(p.name.startswith("step-") and (p / "piper.json").is_file() for p in tmp_path.iterdir())


class _StopAt(_StepSink):
    """A sink that asks ``stop`` to stop once step ``at`` is reported."""

    def __init__(self, stop: StopRequest, at: int) -> None:
        self.stop, self.at = stop, at

    def on_step(self, metrics, result) -> None:
        if metrics.step == self.at:
            self.stop.request("asked")


def test_a_stop_while_a_checkpoint_is_written_completes_it_and_the_run_resumes_exactly(tmp_path, runtime) -> None:
    """Stopped as step 3's checkpoint starts being written while training would go on: the
    run ends at step 3 (nothing is sent after a checkpoint's step before it is taken), with
    that checkpoint complete, and resumes from it like an uninterrupted run."""
    steps = 8
    workload = build_model("mlp", stages=2, seed=17)
    strategy = build_schedule("1f1b", 2, 2, stages=2)
    whole, expected = _oracle(17, steps, runtime)
    root = Checkpoints(tmp_path, every=3, asynchronous=True)
    with _trainer(workload, strategy) as trainer:
        stop = StopRequest()
        first = fit(trainer, workload.stream(), steps=steps, checkpoints=root, sinks=[_StopAt(stop, 3)], stop=stop,
                    steps_per_call=1)
    assert first.stopped == "asked" and [m.step for m in first.steps] == [1, 2, 3]
    assert [p.name for p in first.checkpoints] == [p.name for p in tmp_path.iterdir()] == ["step-00000003"]
    assert (tmp_path / "step-00000003" / "piper.json").is_file()
    with _trainer(workload, strategy) as trainer:
        second = fit(trainer, workload.stream(), steps=steps, checkpoints=root, resume=True)
        assert [m.loss for m in first.steps + second.steps] == [m.loss for m in whole.steps]
        assert _equal(trainer.parameters(), expected)


@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_a_stop_ends_at_a_step_with_its_checkpoint_and_the_run_resumes_exactly(tmp_path, steps_per_call, runtime) -> None:
    """What ``piper train`` does on SIGTERM: no step is sent after the request, those sent
    finish, the last is checkpointed, and a resumed run ends like an uninterrupted one."""
    steps = 8
    workload = build_model("mlp", stages=2, seed=17)
    strategy = build_schedule("1f1b", 2, 2, stages=2)
    whole, expected = _oracle(17, steps, runtime)
    root = Checkpoints(tmp_path, every=100)  # none on the way: the stop writes the only one
    with _trainer(workload, strategy) as trainer:
        stop = StopRequest()
        first = fit(trainer, workload.stream(), steps=steps, checkpoints=root, sinks=[_StopAt(stop, 3)], stop=stop,
                    steps_per_call=steps_per_call)
        stopped_at = trainer.state.step
    assert first.stopped == "asked"
    # Step 3's result arrives with one call in flight ahead of the one it came in: [4], or
    # [5, 6] after [3, 4]. Those finish; nothing is sent after them.
    assert stopped_at == {1: 4, 2: 6}[steps_per_call] and first.calls == (steps_per_call,) * (stopped_at // steps_per_call)
    assert [m.step for m in first.steps] == list(range(1, stopped_at + 1))
    assert [p.name for p in tmp_path.iterdir()] == [f"step-{stopped_at:08d}"]
    with _trainer(workload, strategy) as trainer:
        second = fit(trainer, workload.stream(), steps=steps, checkpoints=root, resume=True)
        assert second.stopped is None
        assert [m.loss for m in first.steps + second.steps] == [m.loss for m in whole.steps]
        assert _equal(trainer.parameters(), expected)
    with _trainer(workload, strategy) as trainer:  # asked for after the last step: not a stop
        late = StopRequest()
        done = fit(trainer, workload.stream(), steps=2, sinks=[_StopAt(late, 2)], stop=late)
    assert late and done.stopped is None and len(done.steps) == 2


def test_cli_checkpoints_resume_and_export(tmp_path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    base = ["train", "--model", "mlp", "--pp", "2", "--microbatches", "2", "--optimizer", "adam", "--json",
            "--no-progress-bar"]
    saving = [*base, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--keep-checkpoints", "2"]
    assert main([*saving, "--steps", "3"]) == 0
    out, err = capsys.readouterr()
    first = json.loads(out)
    assert f"checkpoint after step 2: {ckpt / 'step-00000002'} (" in err  # said as it is written, with its size
    assert [p.rsplit("/", 1)[1] for p in first["checkpoints"]] == ["step-00000002", "step-00000003"]
    assert main([*saving, "--steps", "3"]) == 2
    assert "already holds checkpoints (the latest: step-00000003); pass --resume" in capsys.readouterr().err
    assert main([*saving, "--steps", "5", "--resume"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["first_step"] == 4 and second["steps"] == 2
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004", "step-00000005"]  # the newest 2 kept
    assert main([*base, "--steps", "5"]) == 0
    assert first["losses"] + second["losses"] == json.loads(capsys.readouterr().out)["losses"]

    assert main(["export", str(ckpt), "--out", str(tmp_path / "model.pt")]) == 0
    assert "to " + str(tmp_path / "model.pt") in capsys.readouterr().out
    build_model("mlp", stages=2).model.load_state_dict(torch.load(tmp_path / "model.pt"))

    # Bad input, each refused before any worker starts, nothing deleted.
    assert main([*saving, "--stages", "4", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "saved from another model: parameters missing from the checkpoint" in err
    assert "a built-in model's depth follows --stages (here 4, " in err
    assert main([*base, "--checkpoint-dir", str(tmp_path / "empty"), "--resume"]) == 2
    assert "nothing to resume from" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "empty"), "--out", str(tmp_path / "x.pt")]) == 2
    assert f"nothing to export: {tmp_path / 'empty'} does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--resume"])
    assert "--resume needs --checkpoint-dir" in capsys.readouterr().err
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004", "step-00000005"]
    (ckpt / "step-00000005" / "piper.json").write_text("{damaged")
    assert main([*saving, "--steps", "6", "--resume"]) == 2
    assert (f"not a readable checkpoint manifest (Expecting property name enclosed in double quotes: line 1 column 2 "
            f"(char 1)); to resume from the checkpoint before it, move {ckpt / 'step-00000005'} out of {ckpt}"
            ) in capsys.readouterr().err
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004", "step-00000005"]


def test_parameters_forward_never_uses_are_checked_resumed_and_exported(tmp_path, capsys) -> None:
    """Such parameters stay as given, as on one device (``check`` compares them too), and a
    checkpoint carries them: the run resumes from its own checkpoint, and the export loads
    into the model with every key."""
    model = f"{USER_MODEL}:with_unused"
    assert main(["check", "--model", model, "--steps", "2", "--dp", "2", "--zero", "2"]) == 0
    assert "PASS" in capsys.readouterr().out
    ckpt = tmp_path / "ckpt"
    base = ["train", "--model", model, "--microbatches", "2", "--json", "--checkpoint-dir", str(ckpt)]
    assert main([*base, "--steps", "2"]) == 0
    said = capsys.readouterr().err
    assert "2 parameter(s) not used by forward, so not trained" in said and "spare.weight, spare.bias" in said
    assert main([*base, "--steps", "3", "--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["first_step"] == 3
    assert main(["export", str(ckpt), "--out", str(tmp_path / "model.pt")]) == 0
    state = torch.load(tmp_path / "model.pt")
    fresh = load_factory(model).model
    fresh.load_state_dict(state)  # every key, strictly
    assert torch.equal(state["spare.weight"], fresh.spare.weight)  # as given: seeded the same


def test_a_run_resumed_with_more_epochs_trains_the_next_epoch_whole(tmp_path, capsys) -> None:
    """``fit`` never draws the batch after the last epoch (the data knows its length), so the
    checkpoint's data position is the end of that epoch, not one batch into the next."""
    base = ["train", "--model", f"{FIXTURE}:make", "--batch-size", "8", "--pp", "2", "--microbatches", "2", "--json",
            "--no-progress-bar"]
    saving = [*base, "--checkpoint-dir", str(tmp_path / "ckpt")]
    runs = []
    for argv in ([*saving, "--epochs", "1"], [*saving, "--epochs", "2", "--resume"], [*base, "--epochs", "2"]):
        assert main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out))
    first, resumed, whole = runs
    # 36 samples: 4 full batches of 8 per epoch and a partial one of 4, which trains.
    assert (first["steps"], resumed["first_step"], resumed["steps"], whole["steps"]) == (5, 6, 5, 10)
    assert first["losses"] + resumed["losses"] == whole["losses"]
