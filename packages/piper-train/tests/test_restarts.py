"""Which failures ``fit`` restarts for, without workers: a trainer whose steps and checkpoint
writes fail as each test says. A lost worker is restarted for; a full disk, a refused
permission, a NaN or a failure that comes back the same way at the same step are not, and the
error says the cause first and why it was not restarted for."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ray.exceptions import RayTaskError

from piper_ir import ExecutionError, HangError, NumericalError
from piper_ir.errors import StorageError
from piper_train.checkpoints import Checkpoints
from piper_train.loop import fit
from piper_train.schedule import LearningRate
from piper_train.state import TrainState

BATCHES = [((torch.full((2, 1), float(k)),), (torch.zeros(2, 1),)) for k in range(8)]


def _rank_failed(err: BaseException, rank: int = 0) -> ExecutionError:
    """An error as ``Runtime._gather`` raises it for a worker's exception: built while the Ray
    task error is handled, the worker's traceback in its message."""
    try:
        raise RayTaskError("RankWorker.run", f"Traceback ...\n{type(err).__name__}: {err}", err)
    except RayTaskError as exc:
        try:
            raise ExecutionError(f"rank {rank} failed during step:\n{exc}", ranks=(rank,))
        except ExecutionError as raised:
            return raised


class _Pending:
    def __init__(self, step: int, error: ExecutionError | None) -> None:
        self.step, self.error = step, error

    def result(self) -> SimpleNamespace:
        if self.error is not None:
            raise self.error
        return SimpleNamespace(loss=1.0, lr=0.1, grad_norm=None, memory=(), nonfinite=False, skipped=False)


class FakeTrainer:
    """What ``fit`` uses of a ``Trainer``: ``step_error(step, attempt)`` is the error step
    ``step`` fails with on the ``attempt``-th set of workers (None: it passes);
    ``save_error(step)`` likewise for the checkpoint after it."""

    def __init__(
        self,
        step_error: Callable[[int, int], ExecutionError | None] = lambda step, attempt: None,
        save_error: Callable[[int], BaseException | None] = lambda step: None,
    ) -> None:
        self.runtime = SimpleNamespace(on_nan="stop")
        self.seed = 0
        self.batch_size = 2
        self.state = TrainState(LearningRate(0.1))
        self.step_error, self.save_error = step_error, save_error
        self.restarts = 0

    def submit_steps(self, batches, *, profile, memory) -> list[_Pending]:
        pending = []
        for _ in batches:
            self.state.advance(self.batch_size, 0)
            error = self.step_error(self.state.step, self.restarts)
            if error is not None:
                error.step = self.state.step
            pending.append(_Pending(self.state.step, error))
        return pending

    def restart(self) -> None:
        self.restarts += 1

    def throughput(self, hardware=None) -> None:
        return None  # no FLOPs: the steps report no TFLOP/s

    def save_checkpoint(self, target: Path) -> Path:
        error = self.save_error(self.state.step)
        if error is not None:
            raise error
        target.mkdir(parents=True)
        return target

    def begin_checkpoint(self, target: Path) -> SimpleNamespace:
        """A checkpoint the ranks write while the next steps run: its error comes at ``finish``."""
        error = self.save_error(self.state.step)

        def finish() -> Path:
            if error is not None:
                raise error
            target.mkdir(parents=True)
            return target

        return SimpleNamespace(path=target, manifest={"step": self.state.step}, started=0.0, staged_seconds=0.0,
                               finish=finish, done=lambda: True, abandon=lambda: None)


def _enospc(path: str = "/ckpt/.tmp/rank-0") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def test_a_lost_worker_is_restarted_for() -> None:
    trainer = FakeTrainer(lambda step, attempt: ExecutionError("rank 1 died during step") if (step, attempt) == (3, 0)
                          else None)
    run = fit(trainer, BATCHES, steps=5, max_restarts=1, steps_per_call=1)
    assert trainer.restarts == 1 and [r.failed_step for r in run.restarts] == [3]
    assert [m.step for m in run.steps] == [1, 2, 3, 4, 5]


def test_a_hang_and_a_raise_that_pass_are_restarted_for_each_time() -> None:
    """Different failures (a hang, then a peer's broken connection) at the same step: each
    may pass, so each is restarted for."""
    errors = {0: HangError("step 2: rank 1 made no progress"), 1: _rank_failed(RuntimeError("Connection closed"))}
    trainer = FakeTrainer(lambda step, attempt: errors.get(attempt) if step == 2 else None)
    run = fit(trainer, BATCHES, steps=3, max_restarts=2, steps_per_call=1)
    assert trainer.restarts == 2 and len(run.restarts) == 2 and run.steps[-1].step == 3


def test_a_failure_that_comes_back_the_same_way_is_restarted_for_once() -> None:
    """The model's code raising at step 3 raises there again after a restart: the second time,
    ``fit`` stops instead of spending the other restarts on it."""
    trainer = FakeTrainer(lambda step, attempt: _rank_failed(ValueError("shapes (4, 3) and (5, 3)"))
                          if step == 3 else None)
    with pytest.raises(ExecutionError) as raised:
        fit(trainer, BATCHES, steps=5, max_restarts=5, steps_per_call=1)
    assert trainer.restarts == 1
    message = str(raised.value)
    assert "ValueError: shapes (4, 3) and (5, 3)" in message
    assert "not restarted: it failed the same way at step 3 after a restart" in message


def test_a_nan_is_not_restarted_for_and_says_why() -> None:
    trainer = FakeTrainer(lambda step, attempt: NumericalError("NaN loss at microbatch 0") if step == 2 else None)
    with pytest.raises(NumericalError, match="not restarted: the same data gives the same NaN"):
        fit(trainer, BATCHES, steps=4, max_restarts=3, steps_per_call=1)
    assert trainer.restarts == 0


@pytest.mark.parametrize("asynchronous", [False, True], ids=["written", "written-while-training"])
@pytest.mark.parametrize("where", ["driver", "rank"])
def test_a_full_disk_is_said_first_and_not_restarted_for(tmp_path, where, asynchronous) -> None:
    """No space left for a checkpoint, on the driver (its metadata) or on a rank (its files):
    the error names the checkpoint and the cause on its first line, and restarting (which
    would recompute the steps only to meet the same full disk) is not tried."""
    failure = _enospc() if where == "driver" else _rank_failed(_enospc(), rank=1)
    trainer = FakeTrainer(save_error=lambda step: failure if step == 2 else None)
    with pytest.raises(StorageError) as raised:
        fit(trainer, BATCHES, steps=4, checkpoints=Checkpoints(tmp_path, every=2, asynchronous=asynchronous),
            max_restarts=2, steps_per_call=1)
    lines = str(raised.value).splitlines()
    assert lines[0] == f"no space left on device writing checkpoint {tmp_path / 'step-00000002'}"
    assert lines[1].strip().startswith("not restarted: a full disk")
    assert "Traceback" not in str(raised.value) and trainer.restarts == 0
    assert not raised.value.transient
    if where == "rank":
        assert raised.value.ranks == (1,)


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.EDQUOT])
def test_a_refused_write_without_restarts_names_the_cause(tmp_path, code) -> None:
    trainer = FakeTrainer(save_error=lambda step: OSError(code, os.strerror(code)))
    with pytest.raises(StorageError) as raised:
        fit(trainer, BATCHES, steps=1, checkpoints=Checkpoints(tmp_path))
    cause = os.strerror(code)
    assert str(raised.value) == f"{cause[0].lower()}{cause[1:]} writing checkpoint {tmp_path / 'step-00000001'}"


def test_another_failed_write_is_restarted_for(tmp_path) -> None:
    """An I/O error (a network filesystem's hiccup) may pass: the run restarts from its start
    and writes the checkpoint the second time."""
    errors = [OSError(errno.EIO, os.strerror(errno.EIO))]
    trainer = FakeTrainer(save_error=lambda step: errors.pop() if errors else None)
    run = fit(trainer, BATCHES, steps=2, checkpoints=Checkpoints(tmp_path), max_restarts=1, steps_per_call=1)
    assert trainer.restarts == 1 and "writing checkpoint" in run.restarts[0].error
    assert [p.name for p in run.checkpoints] == ["step-00000002"]


def test_storage_error_of_keeps_only_failures_that_stay() -> None:
    assert StorageError.of(OSError(errno.ECONNRESET, "reset"), "writing x") is None
    assert StorageError.of(OSError(errno.EIO, "I/O"), "writing x") is None
    made = StorageError.of(_enospc(), "writing checkpoint /c", ranks=(0,), step=4)
    assert made is not None and made.message == "no space left on device writing checkpoint /c"
    assert (made.ranks, made.step) == ((0,), 4)
    assert ExecutionError.transient and HangError.transient and not NumericalError.transient
