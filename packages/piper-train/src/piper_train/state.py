"""``TrainState``: the training loop's own state, what a checkpoint holds besides the model.

The parameters and optimizer state live on the ranks; everything else a run needs to
continue exactly lives here, on the driver, as one object with ``state_dict`` /
``load_state_dict`` (plain Python and tensors: data a checkpoint holds as JSON and tensors,
``piper_runtime.checkpoint_files.encode``):

- ``step``: optimizer steps taken; ``samples``, ``tokens``: how much data they consumed;
- ``lr``: the learning-rate schedule's position (``LearningRate``: the torch scheduler's own
  ``state_dict``), so the next step's learning rate is the one an uninterrupted run uses;
- ``data``: where the batch stream stands (``BatchStream.state_dict``: epoch and batch
  within it; with its seed that fixes every later batch), when the loop has one;
- ``rng``: the driver's random number generators (torch, Python's ``random``), which a
  user's data pipeline may draw from.
"""

from __future__ import annotations

import random
from typing import Any, Protocol

import torch

from piper_train.schedule import LearningRate


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainState:
    """The loop's state (module doc)."""

    def __init__(self, lr: LearningRate) -> None:
        self.step = 0
        self.samples = 0
        self.tokens = 0
        self.lr = lr
        self.data: Stateful | None = None

    def advance(self, samples: int, tokens: int) -> None:
        """One optimizer step on ``samples`` samples (``tokens`` tokens) is done."""
        self.step += 1
        self.samples += samples
        self.tokens += tokens
        self.lr.advance()

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "samples": self.samples,
            "tokens": self.tokens,
            "lr": self.lr.state_dict(),
            "data": self.data.state_dict() if self.data is not None else None,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.samples, self.tokens = state["step"], state["samples"], state["tokens"]
        self.lr.load_state_dict(state["lr"])
        if state.get("data") is not None:
            if self.data is None:
                raise ValueError("the state has a data position but the loop has no batch stream to restore it to")
            self.data.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
