"""piper-train: the front door composing Piper's packages (Trainer, reference, the piper CLI)."""

import importlib

from piper_train._version import __version__ as __version__

# name -> module that defines it; imported on first use, so `import piper_train.models` stays light
_LAZY = {
    "Trainer": "piper_train.trainer",
    "ReferenceTrainer": "piper_train.reference",
    "run_check": "piper_train.check",
    "build_model": "piper_train.models",
    "load_workload": "piper_train.workload",
    "LRSchedule": "piper_train.schedule",
    "TrainState": "piper_train.state",
    "BatchStream": "piper_train.batches",
    "fit": "piper_train.loop",
    "StopRequest": "piper_train.stopping",
    "Checkpoints": "piper_train.checkpoints",
    "export": "piper_train.checkpoints",
    "tune": "piper_train.tuning.api",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    return getattr(importlib.import_module(module), name)
