"""Learning-rate schedules: the values of each named schedule, the driver's LearningRate equal
to torch's scheduler on a real optimizer (what the reference runs), and its state."""

from __future__ import annotations

import math

import pytest
import torch

from piper_runtime import OptimizerSpec
from piper_train.schedule import SCHEDULES, LearningRate, LRSchedule


def _lrs(schedule: LRSchedule, steps: int, lr: float = 1.0) -> list[float]:
    clock = LearningRate(lr, schedule)
    out = []
    for _ in range(steps):
        out.append(clock.current)
        clock.advance()
    return out


def test_warmup_then_cosine_decays_to_the_minimum_at_the_last_step() -> None:
    got = _lrs(LRSchedule("cosine", warmup_steps=3, total_steps=10, min_lr=0.1), 11)
    assert got[:4] == pytest.approx([1 / 4, 2 / 4, 3 / 4, 1.0])  # nanoGPT: lr * (k + 1) / (W + 1)
    for k in range(3, 11):
        want = 0.1 + 0.9 * (1 + math.cos(math.pi * (k - 3) / 7)) / 2
        assert got[k] == pytest.approx(want)


def test_linear_step_and_constant() -> None:
    assert _lrs(LRSchedule("linear", 0, 4, 0.2), 6) == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    assert _lrs(LRSchedule("step", step_size=2, gamma=0.5), 6) == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.25])
    assert _lrs(LRSchedule("constant", warmup_steps=1), 3, lr=0.3) == pytest.approx([0.15, 0.3, 0.3])
    assert _lrs(LRSchedule(), 3, lr=0.3) == [0.3, 0.3, 0.3]


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_driver_follows_torchs_scheduler_on_the_reference_optimizer(name: str) -> None:
    """The driver's stand-in and a real two-group optimizer (weight decay groups) give the
    same learning rate, bit for bit, every step: what the ranks use is what one device uses."""
    schedule = LRSchedule(name, warmup_steps=2, total_steps=7, min_lr=1e-4, step_size=2, gamma=0.3)
    model = torch.nn.Linear(3, 2)
    opt = OptimizerSpec("adamw", 3e-3, weight_decay=0.1).build_named(model.named_parameters())
    scheduler = schedule.build(opt)
    clock = LearningRate(3e-3, schedule)
    for _ in range(9):
        assert [g["lr"] for g in opt.param_groups] == [clock.current] * 2
        opt.step()
        scheduler.step()
        clock.advance()


def test_state_dict_restores_the_position() -> None:
    schedule = LRSchedule("cosine", 2, 8)
    clock = LearningRate(1.0, schedule)
    for _ in range(5):
        clock.advance()
    state = clock.state_dict()
    rest = [clock.current]
    for _ in range(3):
        clock.advance()
        rest.append(clock.current)
    resumed = LearningRate(1.0, schedule)
    resumed.load_state_dict(state)
    again = [resumed.current]
    for _ in range(3):
        resumed.advance()
        again.append(resumed.current)
    assert again == rest


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "exponential"}, "unknown learning-rate schedule 'exponential'; choose from constant, cosine"),
        ({"name": "cosine"}, "needs the number of steps"),
        ({"name": "step"}, "needs a step size"),
        ({"warmup_steps": -1}, "warm-up steps must be >= 0"),
    ],
)
def test_bad_schedules_name_the_culprit(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LRSchedule(**kwargs)


def test_the_drivers_schedule_does_not_import_torch_dynamo() -> None:
    # A torch optimizer's construction imports torch._dynamo (about 2 s of start-up); the
    # driver's stand-in has no parameters to step, so it goes without.
    import subprocess
    import sys

    code = ("import sys\nfrom piper_train.schedule import LearningRate, LRSchedule\n"
            "clock = LearningRate(0.1, LRSchedule('cosine', warmup_steps=2, total_steps=5))\n"
            "[clock.advance() for _ in range(3)]\nclock.load_state_dict(clock.state_dict())\n"
            "print(round(clock.current, 6), 'torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    want = _lrs(LRSchedule("cosine", warmup_steps=2, total_steps=5), 4, lr=0.1)[3]
    assert done.stdout.split() == [str(round(want, 6)), "False"]
